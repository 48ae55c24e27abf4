"""Which key tile and O store serve a head-dim pair best: the library's forward for one point
with ``tile_n`` and ``o_store`` pinned (``lab.variants.variant_config``; the K/V ring depth
follows from them), timed side by side in one process, bf16. The measurements that chose
``config.allowed_tiles``' rule are in docs/performance.md.

    python -m lab.tune_head_dims --dims 192,128 --tiles 128,112,96,80 --out results/bench/head_dims/tune.json
"""

import argparse

import torch

from fmha.kernels.hopper.forward_runner import HopperRunner, compile_forward
from fmha.kernels.hopper.config import HopperForwardConfig, OStore
from fmha.problem import KernelOptions
from fmha.validation import validate
from lab.bench_head_dims import flops
from lab.timing import keep_row, seconds_per_call
from lab.variants import variant_config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", action="append", required=True, help="D,D_v (repeatable)")
    ap.add_argument("--tiles", default="128,112,96,80")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    rows = []
    for dims in args.dims:
        d, dv = map(int, dims.split(","))
        for causal in (False, True):
            b, s, h = args.batch, args.seqlen, 16
            g = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
            k = torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16)
            v = torch.randn(b, s, h, dv, generator=g, device="cuda", dtype=torch.bfloat16)
            problem = validate(q, k, v, causal=causal)
            base = HopperForwardConfig.from_problem(problem, KernelOptions())
            want = None
            for tile_n in map(int, args.tiles.split(",")):
                for o_store in (OStore.TMA_OWN_BUFFER, OStore.DIRECT):
                    row = dict(point=f"B{b} S{s} H{h} D{d}/{dv}" + (" causal" if causal else ""), tile_n=tile_n,
                               o_store=o_store.value, library=(tile_n, o_store) == (base.tile_n, base.o_store))
                    try:
                        cfg = variant_config(base, tile_n=tile_n, o_store=o_store)
                        row["kv_stages"] = cfg.kv_stages
                        runner = HopperRunner(cfg, compile_forward(cfg))
                        out = q.new_empty(q.shape[:-1] + (dv,))

                        def fn():
                            runner(problem, q, k, v, out, None)
                        row["tflops"] = round(flops(b, s, h, d, dv, causal) / seconds_per_call(fn, args.rep) / 1e12, 1)
                        if want is None:
                            want = out.float().clone()
                        row["rel_diff"] = float(((out.float() - want).norm() / want.norm()).item())
                    except Exception as e:  # a configuration that does not fit
                        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                    keep_row(rows, row, args.out)


if __name__ == "__main__":
    main()
