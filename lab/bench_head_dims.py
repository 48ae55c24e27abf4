"""The forward at head dims beyond 64/128/256 and with V's head dim unlike Q's (192/128 is
DeepSeek-V3's prefill), side by side in one process with FlashAttention-4 at the same shapes,
bf16, with 128/128 as the plain point of comparison. Each row checks fmha against FA4's output.

    python lab/bench_head_dims.py --out results/bench/head_dims/head_dims.json
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fmha  # noqa: E402
from lab.timing import keep_row, seconds_per_call  # noqa: E402

POINTS = [  # (B, S, H_q, H_k, D, D_v, causal)
    (2, 8192, 16, 16, 128, 128, False),
    (2, 8192, 16, 16, 192, 128, False),
    (2, 8192, 16, 16, 192, 128, True),
    (2, 8192, 16, 16, 192, 192, False),
    (2, 8192, 16, 16, 192, 192, True),
    (4, 4096, 16, 16, 96, 96, False),
    (4, 4096, 16, 16, 96, 96, True),
    (2, 8192, 16, 16, 128, 64, False),
]


def flops(b, s, hq, d, dv, causal):
    return 2 * b * hq * s * s * (d + dv) / (2 if causal else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--dims", default="", help="only these D/D_v pairs, e.g. 192/128,128/128")
    args = ap.parse_args()
    wanted = set(filter(None, args.dims.split(",")))
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError as e:
        fa4 = None
        print("no FA4:", e)
    rows = []
    for b, s, hq, hk, d, dv, causal in POINTS:
        if wanted and f"{d}/{dv}" not in wanted:
            continue
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, dv, generator=g, device="cuda", dtype=torch.bfloat16)
        point = f"B{b} S{s} H{hq}/{hk} D{d}/{dv}" + (" causal" if causal else "")
        row = dict(point=point)
        outs = {}
        impls = {"fmha": lambda: fmha.attention(q, k, v, causal=causal, backend="kernel")}
        if fa4 is not None:
            impls["fa4"] = lambda: fa4(q, k, v, causal=causal)
        for name, fn in impls.items():
            try:
                with torch.no_grad():
                    out = fn()
                    outs[name] = out[0] if isinstance(out, tuple) else out
                    row[name] = round(flops(b, s, hq, d, dv, causal) / seconds_per_call(fn, args.rep) / 1e12, 1)
            except Exception as e:  # a peer without the shape
                row[name] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if row.get("fmha") and row.get("fa4"):
            row["fmha/fa4"] = round(row["fmha"] / row["fa4"], 3)
            a, w = outs["fmha"].float(), outs["fa4"].float()
            row["rel_diff_vs_fa4"] = float(((a - w).norm() / w.norm()).item())
        keep_row(rows, row, args.out)


if __name__ == "__main__":
    main()
