"""How many probabilities the forward's softmax exponentiates on the FMA pipe instead of the
MUFU (``OnlineSoftmax.exp2_on_fma_eighths``, pinned through ``lab.variants.variant_config``):
each share timed side by side in one process with plain attention and FlashAttention-4, with
and without softcap (whose tanh shares the MUFU with exp2), bf16. The measurements that chose
``HopperForwardConfig.exp2_on_fma_eighths`` are in docs/performance.md.

    source .device-bundle/activate.sh && python -m lab.tune_exp2 --out $OUT/exp2.json
    python -m lab.tune_exp2 --profile --dims 128 --eighths 0,4   # a few calls each, for ncu
"""

import argparse
import math
import os
import time

import torch

from fmha.kernels.hopper.config import HopperForwardConfig
from fmha.problem import KernelOptions
from fmha.validation import validate
from lab.timing import keep_row, seconds_per_call
from lab.variants import variant_config

SOFTCAP = 30.0


def _compile_into(cache_dir: str, cfg):
    """Worker: compile ``cfg`` into fmha's disk cache at ``cache_dir``."""
    os.environ["FMHA_CACHE_DIR"] = cache_dir
    from fmha.jit import disk_cache
    from fmha.kernels.hopper.backend import compile_forward

    disk_cache.load_or_compile(cfg, compile_forward)


def reference(q, k, v, causal: bool, softcap: float) -> torch.Tensor:
    """fp32 attention of batch 0, every head, in chunks of queries."""
    q, k, v = (t[0].float().transpose(0, 1) for t in (q, k, v))  # (H, S, D)
    scale, s_len = q.shape[-1] ** -0.5, q.shape[1]
    out = torch.empty_like(q)
    for a in range(0, s_len, 1024):
        s = q[:, a:a + 1024] @ k.transpose(1, 2) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if causal:
            rows = torch.arange(a, min(a + 1024, s_len), device=q.device)[:, None]
            s = s.masked_fill(torch.arange(s_len, device=q.device)[None] > rows, -math.inf)
        out[:, a:a + 1024] = s.softmax(-1) @ v
    return out.transpose(0, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--eighths", default="0,2,4,6")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--profile", action="store_true", help="three untimed calls of each kernel (for ncu)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    eighths = [int(x) for x in args.eighths.split(",")]
    points = []
    for d in (int(x) for x in args.dims.split(",")):
        b, s = (4, 4096) if d <= 64 else (2, 8192)
        for causal in (False, True):
            points.append((b, s, 16, d, causal))
    cases = []  # (point, name, softcap, config)
    for b, s, h, d, causal in points:
        q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="cuda")
        for softcap in (0.0, SOFTCAP):
            problem = validate(q, q, q, causal=causal, softcap=softcap)
            base = HopperForwardConfig.from_problem(problem, KernelOptions())
            for e in eighths:
                name = ("softcap" if softcap else "plain") + f"_fma{e}" + ("*" if e == base.exp2_on_fma_eighths else "")
                cases.append(((b, s, h, d, causal), name, softcap, problem, variant_config(base, exp2_on_fma_eighths=e)))
    start = time.time()
    import multiprocessing as mp

    from fmha.jit import disk_cache
    with mp.get_context("spawn").Pool(args.workers) as pool:
        pool.starmap(_compile_into, [(str(disk_cache.cache_dir()), c[-1]) for c in cases])
    print(f"compiled {len(cases)} kernels in {time.time() - start:.0f} s", flush=True)

    from fmha.kernels.hopper.backend import HopperRunner, compile_forward
    rows, want = [], {}
    for point in points:
        b, s, h, d, causal = point
        label = f"B{b} S{s} H{h} D{d}" + (" causal" if causal else "")
        gen = torch.Generator(device="cuda").manual_seed(d + causal)
        q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        fns = {}
        for pt, name, softcap, problem, cfg in cases:
            if pt != point:
                continue
            runner = HopperRunner(cfg, disk_cache.load_or_compile(cfg, compile_forward))
            out = torch.full_like(q, float("nan"))

            def fn(runner=runner, problem=problem, out=out):
                runner(problem, q, k, v, out, None)
                return out
            fns[name] = (fn, softcap)
        try:
            from flash_attn.cute import flash_attn_func as fa4

            for softcap in (0.0, SOFTCAP):
                def fa4_fn(softcap=softcap):
                    out = fa4(q, k, v, causal=causal, softcap=softcap)
                    return out[0] if isinstance(out, tuple) else out
                fns["fa4_" + ("softcap" if softcap else "plain")] = (fa4_fn, softcap)
        except ImportError as e:
            print("no FA4:", e)
        for name, (fn, softcap) in fns.items():
            row = dict(point=label, impl=name)
            if args.profile:
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                continue
            sec = seconds_per_call(fn, args.rep)
            row["tflops"] = round(flops / sec / 1e12, 1)
            if softcap not in want:
                want[softcap] = reference(q, k, v, causal, softcap)
            o = fn()[0].float()
            row["rel_err"] = float((o - want[softcap]).norm() / want[softcap].norm())
            keep_row(rows, row, args.out)
        want.clear()
    print(f"done in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
