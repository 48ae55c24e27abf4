"""Call one benchmark implementation a few times on one point, for a profiler to capture (GPU).

    ncu --clock-control none -k regex:"HopperAttentionForward|FlashAttentionForwardSm90" \\
        --launch-skip 2 --launch-count 1 --set full -o OUT/fmha \\
        python scripts/profile_kernel.py --impl fmha --batch 1 --seqlen 16384 --heads 16 --head-dim 128
    ncu -i OUT/fmha.ncu-rep --page source --csv --print-source sass > OUT/fmha_sass.csv

The calls are the benchmark's own (``fmha.bench``), so the kernel profiled is the one timed there:
``--impl`` takes any of its implementation names (fmha, fa4, fmha_<variant>, ...).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", default="fmha")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--heads-k", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--calls", type=int, default=3, help="calls after the compiling one")
    args = ap.parse_args(argv)

    import torch

    from fmha.bench import Point, _implementations, _inputs

    p = Point(args.batch, args.seqlen, args.heads, args.heads_k or args.heads, args.head_dim, args.causal)
    impls = _implementations(torch, variants=args.impl not in ("fmha", "fa4", "cudnn", "sdpa_flash"))
    fn = impls[args.impl]
    q, k, v, cu = _inputs(p, torch)
    for _ in range(1 + args.calls):
        fn(q, k, v, p, cu)
    torch.cuda.synchronize()
    print(f"{args.impl} {p.label()}: {1 + args.calls} calls done")


if __name__ == "__main__":
    main()
