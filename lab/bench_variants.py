"""The variants' cost, side by side in one process: fmha plain / softcap / sinks / both against
FlashAttention-4 with the same variant (its ``softcap`` and ``learnable_sink``), forward and
forward + backward, bf16. ``--plain-only`` times fmha's plain attention alone: run once with an
older fmha first on PYTHONPATH for a before/after of the same call.

    python lab/bench_variants.py --out results/bench/variants      # from the repository root
"""

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # lab
sys.path.insert(0, os.environ.get("FMHA_PATH", ROOT))  # fmha, possibly an older tree's
import fmha  # noqa: E402
from lab.timing import keep_row, seconds_per_call  # noqa: E402

POINTS = [  # (B, S, H_q, H_k, D, causal)
    (2, 8192, 16, 16, 128, False),
    (2, 8192, 16, 16, 128, True),
    (2, 8192, 16, 2, 128, True),
    (4, 4096, 16, 16, 64, True),
]
VARIANTS = {"plain": (0.0, False), "softcap": (30.0, False), "sinks": (0.0, True), "both": (30.0, True)}


def flops(b, s, hq, d, causal, backward):
    f = 4 * b * hq * s * s * d / (2 if causal else 1)
    return f * (3.5 if backward else 1.0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--plain-only", action="store_true")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--label", default="fmha")
    args = ap.parse_args()
    fa4 = None
    if not args.plain_only:
        try:
            from flash_attn.cute import flash_attn_func as fa4
        except ImportError as e:
            print("no FA4:", e)
    rows = []
    for b, s, hq, hk, d, causal in POINTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, hk, d, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, hk, d, generator=g, device="cuda", dtype=torch.bfloat16)
        dout = torch.randn_like(q)
        sinks32 = torch.randn(hq, generator=g, device="cuda")
        point = f"B{b} S{s} H{hq}/{hk} D{d}" + (" causal" if causal else "")
        for var, (softcap, with_sinks) in VARIANTS.items():
            if args.plain_only and var != "plain":
                continue
            impls = [(args.label, "fmha")] + ([("fa4", "fa4")] if fa4 is not None else [])
            for label, impl in impls:
                sinks = sinks32 if with_sinks else None
                if impl == "fmha":
                    kw = dict(causal=causal) if var == "plain" else dict(causal=causal, softcap=softcap, sinks=sinks)
                    fwd = lambda: fmha.attention(q, k, v, **kw)  # noqa: E731
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                    def step():
                        fmha.attention(*leaves, **kw).backward(dout)
                else:
                    sk = None if sinks is None else sinks.to(torch.bfloat16)
                    fkw = dict(causal=causal, softcap=softcap, learnable_sink=sk)
                    fwd = lambda: fa4(q, k, v, **fkw)  # noqa: E731
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

                    def step():
                        out = fa4(*leaves, **fkw)
                        (out[0] if isinstance(out, tuple) else out).backward(dout)
                row = dict(point=point, variant=var, impl=label)
                for kind, fn in (("fwd", fwd), ("fwd+bwd", step)):
                    try:
                        with torch.no_grad() if kind == "fwd" else torch.enable_grad():
                            t = seconds_per_call(fn, args.rep)
                        row[kind] = round(flops(b, s, hq, d, causal, kind != "fwd") / t / 1e12, 1)
                    except Exception as e:  # a peer without the variant
                        row[kind] = None
                        row[f"{kind}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                keep_row(rows, row, args.out)


if __name__ == "__main__":
    main()
