"""What the benchmark scripts share: one timing, one way of keeping their rows, and the report's
"not timed" list and bar plot."""

import json
import os
import sys
import time


def seconds_per_call(fn, rep: int) -> float:
    """Median seconds per call of ``fn`` (``triton.testing.do_bench``, CUDA events), after a
    call that compiles."""
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3


def keep_row(rows: list, row: dict, out: str) -> None:
    """Add ``row``, print it, and rewrite ``out`` (when given) with every row so far: a run cut
    short keeps what it measured."""
    import torch

    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                           command=" ".join(sys.argv), rows=rows), f, indent=1)


def not_timed(rows: list) -> list:
    """Report lines naming the rows that carry an error instead of a time."""
    errors = [f"- {r['label']} {r['impl']}: {r['error']}" for r in rows if "error" in r]
    return ["", "Not timed:"] + errors if errors else []


def bar_plot(path: str, labels: list, impls: list, value, ylabel: str, rotation: int = 30,
             log: bool = False) -> None:
    """One group of bars a label, one bar an impl, of height ``value(label, impl)`` (0: none);
    nothing without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ax.bar([x + i * width for x in range(len(labels))], [value(label, impl) for label in labels], width,
               label=impl)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels, rotation=rotation, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
