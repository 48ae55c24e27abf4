"""Call one benchmark implementation a few times on one point, for a profiler to capture (GPU).

    ncu --clock-control none -k regex:"HopperAttentionForward|FlashAttentionForwardSm90" \\
        --launch-skip 2 --launch-count 1 --set full -o OUT/fmha \\
        python -m lab.profile_kernel --impl fmha --batch 1 --seqlen 16384 --heads 16 --head-dim 128
    ncu -i OUT/fmha.ncu-rep --page source --csv --print-source sass > OUT/fmha_sass.csv
    python -m lab.profile_kernel --summarize OUT/fmha_sass.csv     # stall reasons, hot spots
    python -m lab.profile_kernel --summarize OUT/fmha_sass.csv --runs-per-cta 4096  # fixed vs per-tile costs
    python -m lab.profile_kernel --summarize OUT/fmha_sass.csv --phases 593:1078     # a loop cut at its waits

The calls are the benchmark's own (``lab/bench.py``), so the kernel profiled is the one timed
there: ``--impl`` takes any of its implementation names (fmha, fa4, fmha_<variant>, ...).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _read_source_csv(csv_path: str):
    """(rows, column index by header, count(row, header)) of ncu's per-instruction CSV export."""
    import csv

    with open(csv_path, newline="") as f:
        rows = list(csv.reader(f))
    header_at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[header_at], [r for r in rows[header_at + 1:] if len(r) == len(rows[header_at])]
    col = {h: i for i, h in enumerate(hdr)}
    return data, col, lambda r, h: int((r[col[h]] or "0").replace(",", ""))


def summarize(csv_path: str, top: int = 20) -> str:
    """Markdown: the kernel's warp-stall samples by reason, and the instructions with the most
    samples (ncu's per-instruction source counters, exported as CSV)."""
    from collections import Counter

    data, col, count = _read_source_csv(csv_path)
    reasons = [h for h in col if h.startswith("stall_") and "Not Issued" not in h]
    by_reason = Counter({h[len("stall_"):]: sum(count(r, h) for r in data) for h in reasons})
    samples = sum(count(r, "Warp Stall Sampling (All Samples)") for r in data)
    executed = sum(count(r, "Instructions Executed") for r in data)
    lines = [f"{samples} warp samples, {executed} warp instructions executed", "",
             "| stall reason | samples | share |", "|---|---|---|"]
    lines += [f"| {k} | {v} | {100 * v / samples:.1f}% |" for k, v in by_reason.most_common() if v]
    lines += ["", f"| instruction (top {top} by samples) | share | main reasons |", "|---|---|---|"]
    hot = sorted(data, key=lambda r: -count(r, "Warp Stall Sampling (All Samples)"))[:top]
    for r in hot:
        n = count(r, "Warp Stall Sampling (All Samples)")
        main = ", ".join(f"{h[len('stall_'):]} {100 * count(r, h) / n:.0f}%" for h in reasons
                         if n and count(r, h) > 0.15 * n)
        lines.append(f"| `{r[col['Source']].strip()[:70]}` | {100 * n / samples:.1f}% | {main} |")
    return "\n".join(lines) + "\n"


def runs_per_cta(csv_path: str, ctas: int, min_share: float = 0.3) -> str:
    """Markdown: the kernel's code as runs of consecutive instructions that execute equally often
    per CTA (warp executions / ``ctas``), with their share of the stall samples. Setup, epilogue
    and per-role code run a fixed number of times per CTA (the warps that run it); the loops'
    bodies run that times the tiles: a kernel whose time goes to per-CTA runs pays fixed costs."""
    data, col, count = _read_source_csv(csv_path)
    samples = sum(count(r, "Warp Stall Sampling (All Samples)") for r in data) or 1
    runs = []
    for i, r in enumerate(data):
        per_cta = round(count(r, "Instructions Executed") / ctas, 1)
        n = count(r, "Warp Stall Sampling (All Samples)")
        if runs and runs[-1][0] == per_cta:
            runs[-1][2] = i
            runs[-1][3] += n
        else:
            runs.append([per_cta, i, i, n, r[col["Source"]].strip()])
    lines = ["| instructions | executions per CTA | samples | first instruction |", "|---|---|---|---|"]
    lines += [f"| {first}-{last} | {per_cta} | {100 * n / samples:.1f}% | `{src[:60]}` |"
              for per_cta, first, last, n, src in runs if 100 * n / samples >= min_share]
    return "\n".join(lines) + "\n"


_SYNCHRONIZING = ("DEPBAR", "BAR.", "FENCE", "SYNCS", "MEMBAR", "BRA", "UBLKRED", "UTMA")


def phases(csv_path: str, first: int, last: int) -> str:
    """Markdown: instructions ``first``..``last`` (a loop's body, from ``--runs-per-cta``) cut at
    every synchronizing instruction (waits, barriers, fences, branches), with the samples of the
    stretch of work before each cut and of the cut itself: where two kernels' loops differ."""
    data, col, count = _read_source_csv(csv_path)
    lines = ["| instructions | samples | what runs there |", "|---|---|---|"]
    start, samples, ops = first, 0, {}
    for i in range(first, last + 1):
        src = data[i][col["Source"]].strip()
        n = count(data[i], "Warp Stall Sampling (All Samples)")
        if any(s in src for s in _SYNCHRONIZING):
            if i > start:
                top = ", ".join(f"{k} x{v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5])
                lines.append(f"| {start}-{i - 1} | {samples} | {top} |")
            lines.append(f"| {i} | {n} | `{src[:60]}` |")
            start, samples, ops = i + 1, 0, {}
        else:
            samples += n
            op = next(t for t in src.split() if not t.startswith("@")).split(".")[0]
            ops[op] = ops.get(op, 0) + 1
    if last >= start:
        lines.append(f"| {start}-{last} | {samples} | |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--summarize", metavar="CSV", help="summarize an ncu SASS source export instead")
    ap.add_argument("--runs-per-cta", type=int, metavar="CTAS",
                    help="with --summarize: the code's runs by executions per CTA (the grid's CTA count)")
    ap.add_argument("--phases", metavar="FIRST:LAST",
                    help="with --summarize: instructions FIRST..LAST cut at their synchronizations")
    ap.add_argument("--impl", default="fmha")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-k", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn"])
    ap.add_argument("--varlen", action="store_true",
                    help="the benchmark's packed documents (lab.bench_grid.realistic_lengths) instead of B x S")
    ap.add_argument("--calls", type=int, default=3, help="calls after the compiling one")
    ap.add_argument("--backward", action="store_true",
                    help="call the backward (autograd of the implementation's forward) instead")
    args = ap.parse_args(argv)
    if args.summarize:
        if args.phases:
            print(phases(args.summarize, *map(int, args.phases.split(":"))), end="")
        else:
            print(runs_per_cta(args.summarize, args.runs_per_cta) if args.runs_per_cta else summarize(args.summarize),
                  end="")
        return

    import torch

    from lab.bench import _implementations, _inputs
    from lab.bench_grid import Point, realistic_lengths

    p = Point(args.batch, args.seqlen, args.heads, args.heads_k or args.heads, args.head_dim, args.causal,
              dtype=args.dtype, varlen=realistic_lengths() if args.varlen else None)
    impls = _implementations(torch, variants=args.impl not in ("fmha", "fa4", "cudnn", "sdpa_flash"))
    fn = impls[args.impl]
    q, k, v, cu = _inputs(p, torch)
    if args.backward:
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves, p, cu)
        dout = torch.randn_like(out)
        for _ in range(1 + args.calls):
            torch.autograd.grad(out, leaves, dout, retain_graph=True)
    else:
        for _ in range(1 + args.calls):
            fn(q, k, v, p, cu)
    torch.cuda.synchronize()
    print(f"{args.impl} {p.label()}: {1 + args.calls} calls done")


if __name__ == "__main__":
    main()
