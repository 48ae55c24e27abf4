"""What the small benchmark scripts (``bench_variants``, ``bench_head_dims``, ``tune_head_dims``)
share: one timing and one way of keeping their rows."""

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
