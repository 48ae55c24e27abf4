"""Masked attention's speed, for a before/after of a change to the K/V walk or the mask code:
run it once with an older fmha first on PYTHONPATH (``FMHA_PATH=...``) and once without, in one
device call, alternating. bf16, D=128, 16k tokens per point; forward, and with ``--backward``
forward + backward.

    FMHA_PATH=.fmha-before python lab/bench_masks.py --label before --out $OUT/before.json
    python lab/bench_masks.py --label after --out $OUT/after.json
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

POINTS = {  # name: (B, S, H_q, H_k, options)
    "causal": (2, 8192, 16, 16, dict(causal=True)),
    "gqa_causal": (2, 8192, 16, 2, dict(causal=True)),
    "window_256_256": (2, 8192, 16, 16, dict(window_size=(256, 256))),
    "window_1024_br": (2, 8192, 16, 16, dict(causal=True, window_size=(1024, None), mask_align="bottom_right")),
    "none": (2, 8192, 16, 16, dict()),
}


def kept_pairs(s, options) -> int:
    # fmha.problem.kept_pairs counts the same, but the tree before the walk (FMHA_PATH) lacks it
    from fmha.masking import MaskSpec, row_key_bounds

    m = MaskSpec.from_args(options.get("causal", False), options.get("window_size", (None, None)),
                           options.get("mask_align", "top_left"))
    return sum(max(0, min(hi, s) - max(lo, 0)) for lo, hi in
               (row_key_bounds(i, s, s, m.kind, m.window_left, m.window_right, m.bottom_right) for i in range(s)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--label", default="fmha")
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    rows = []
    d = 128
    for name, (b, s, hq, hk, options) in POINTS.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
                   for h in (hq, hk, hk))
        dout = torch.randn_like(q)
        flops = 4 * b * hq * d * kept_pairs(s, options)
        row = dict(point=name, impl=args.label, fmha=os.path.dirname(os.path.abspath(fmha.__file__)))
        with torch.no_grad():
            row["fwd"] = round(flops / seconds_per_call(lambda: fmha.attention(q, k, v, **options), args.rep) / 1e12, 1)
        if args.backward:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]

            def step():
                fmha.attention(*leaves, **options).backward(dout)
            row["fwd+bwd"] = round(3.5 * flops / seconds_per_call(step, args.rep) / 1e12, 1)
        keep_row(rows, row, args.out)


if __name__ == "__main__":
    main()
