"""Bars of lab/bench_mods.py's TFLOP/s, one group per (case, S), one bar per implementation, a panel
per direction (fwd, fwd+bwd), and a markdown table of the same numbers with fmha's ratios to
FlexAttention, FA4 and its own built-in mask (ratios of TFLOP/s = inverse ratios of time: every
implementation of a point is credited the same FLOPs).

    python lab/plot_mods.py results/mods.json [more.json ...] --out results/mods.png
"""

import argparse
import json

IMPLS = ("fmha", "fmha_builtin", "flex", "fa4", "fa4_builtin")
RATIOS = (("fmha/flex", "flex"), ("fmha/fa4", "fa4"), ("fmha/builtin", "fmha_builtin"))


def load(paths):
    """(case, S, direction) -> impl -> row; a later file's row replaces an earlier one's."""
    points, device = {}, set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        device.add(data.get("device", "?"))
        for r in data["rows"]:
            if "impl" in r:
                points.setdefault((r["case"], r["S"], r["direction"]), {})[r["impl"]] = r
    return points, ", ".join(sorted(device))


def table(points, direction, impls):
    keys = [k for k in points if k[2] == direction]
    lines = [f"### {direction} (TFLOP/s)", "",
             "| case | S | B | " + " | ".join(impls) + " | " + " | ".join(n for n, _ in RATIOS) + " |",
             "|---|---:|---:|" + "---:|" * (len(impls) + len(RATIOS))]
    for key in keys:
        row = points[key]
        cells = []
        for impl in impls:
            r = row.get(impl)
            cells.append("" if r is None else "error" if "error" in r else "skip" if "skipped" in r
                         else f"{r['tflops']:.1f}")
        tf = {i: r["tflops"] for i, r in row.items() if "tflops" in r}
        ratios = [f"{tf['fmha'] / tf[peer]:.2f}" if tf.get("fmha") and tf.get(peer) else "" for _, peer in RATIOS]
        b = next((r["B"] for r in row.values()), "")
        lines.append(f"| {key[0]} | {key[1]} | {b} | " + " | ".join(cells + ratios) + " |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", default="mods.png")
    args = ap.parse_args()
    points, device = load(args.json)
    order = {c: i for i, c in enumerate(dict.fromkeys(k[0] for k in points))}
    points = dict(sorted(points.items(), key=lambda kv: (order[kv[0][0]], kv[0][1], kv[0][2])))
    directions = [d for d in ("fwd", "fwd+bwd") if any(k[2] == d for k in points)]
    impls = [i for i in IMPLS if any(i in row for row in points.values())]

    for d in directions:
        print("\n".join(table(points, d, impls)) + "\n")
    errors = [(k, i, r["error"]) for k, row in points.items() for i, r in row.items() if "error" in r]
    skipped = dict.fromkeys((k[0], i, r["skipped"]) for k, row in points.items() for i, r in row.items()
                            if "skipped" in r)
    if errors or skipped:
        print("### errors / skipped\n")
        for (case, s, d), impl, e in errors:
            print(f"- {case} S={s} {d} {impl}: error {e}")
        for case, impl, why in skipped:
            print(f"- {case} {impl}: skipped, {why}")
        print()
    print("### worst relative L2 error (output; dQ for fwd+bwd)\n")
    for impl in impls:
        errs = [(r.get("err", 0), r.get("err_dq", 0)) for row in points.values() for i, r in row.items()
                if i == impl and "err" in r]
        if errs:
            print(f"- {impl}: out {max(e[0] for e in errs):.2e}, dq {max(e[1] for e in errs):.2e}")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(directions), 1, figsize=(max(8, 1.1 * len(points) / max(1, len(directions))),
                                                          4.2 * len(directions)), squeeze=False)
    width = 0.8 / max(1, len(impls))
    for ax, d in zip(axes[:, 0], directions):
        keys = [k for k in points if k[2] == d]
        for j, impl in enumerate(impls):
            xs = [i + (j - (len(impls) - 1) / 2) * width for i in range(len(keys))]
            ys = [points[k].get(impl, {}).get("tflops", 0) for k in keys]
            ax.bar(xs, ys, width, label=impl)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([k[0].replace("_", "\n", 1) + f"\nS={k[1]}" for k in keys], fontsize=7)
        ax.set_ylabel("TFLOP/s (kept pairs)")
        ax.set_title(f"{d}, bf16, D=128, H=16, 32k tokens ({device})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=len(impls))
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
