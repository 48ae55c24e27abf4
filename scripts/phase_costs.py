"""What each phase of the consumer's K/V step costs: the default Hopper kernel timed beside copies
that leave one phase out (``HopperConfig.drop_phases``). Those copies compute wrong results, so
this is a timing experiment only, never a benchmark: it bounds what speeding a phase up could
buy (if leaving the exponentials out gains 2%, no faster exp can gain more).

    python scripts/phase_costs.py --out results/bench/explore/phase_costs [--rounds 3]
    python scripts/phase_costs.py --set softmax   # exact variants of the softmax step, A/B

Kernels compile in parallel worker processes into the on-disk cache, then one process times
them all, interleaved per point (median of each one's rounds), as ``fmha.bench`` does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fmha.bench import Point, _inputs, _mask_kwargs  # noqa: E402

# name -> HopperConfig overrides; "default" is the library's kernel on this path
VARIANTS = {
    "default": {},
    "no_max": dict(drop_phases=("max",)),  # row max taken as 0: no FMNMX, no shuffles
    "no_exp": dict(drop_phases=("exp",)),  # no MUFU: minus the exponent's argument stands in
    "no_rescale": dict(drop_phases=("rescale",)),  # O never multiplied by the correction
    "no_pack": dict(drop_phases=("pack",)),  # P not converted to the input type
    "softmax_gone": dict(drop_phases=("max", "exp", "sum", "rescale")),
}
# --set softmax: the ninth session's softmax A/B (not timing-only: every variant is exact)
SOFTMAX_VARIANTS = {
    "default": {},
    "default_again": dict(p_buffers=1),  # the same kernel timed twice: the run's noise
    "two_p": dict(p_buffers=2),  # P packed into a second fragment
    "spec": dict(speculative_exp=True),  # exponentials against the kept max, two P fragments
}


def _pt(s, d, causal, dtype="bfloat16"):
    return Point(16384 // s, s, 2048 // d, 2048 // d, d, causal, "phase", dtype)


def default_points() -> list[Point]:
    return [_pt(8192, 128, False, "float8_e4m3fn"), _pt(8192, 128, True, "float8_e4m3fn"),
            _pt(16384, 128, False), _pt(8192, 64, True)]


def softmax_points() -> list[Point]:
    return [_pt(s, 128, c) for c in (False, True) for s in (2048, 8192, 16384)] + [
        _pt(8192, 256, c) for c in (False, True)]


def _config(p: Point, overrides: dict):
    import torch

    from fmha.kernels.hopper.backend import HopperConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    dt = getattr(torch, p.dtype)  # CPU tensors: only the problem's description is needed here
    q, k, v = (torch.empty(p.batch, p.seqlen, h, p.head_dim, dtype=dt) for h in (p.heads_q, p.heads_k, p.heads_k))
    cfg = HopperConfig.from_problem(validate(q, k, v, **_mask_kwargs(p)), KernelOptions())
    return dataclasses.replace(cfg, **overrides)


def _compile(cfg) -> str:
    from fmha.kernels.hopper import disk_cache
    from fmha.kernels.hopper.backend import compile_kernel

    t0 = time.time()
    disk_cache.load_or_compile(cfg, compile_kernel)
    return f"{time.time() - t0:.1f}s"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "explore", "phase_costs"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, default=min(15, os.cpu_count() or 1))
    ap.add_argument("--set", default="phases", choices=["phases", "softmax"])
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    from fmha.kernels.hopper import disk_cache
    from fmha.kernels.hopper.backend import HopperRunner, compile_kernel
    from fmha.validation import validate

    if not torch.cuda.is_available():
        print("phase_costs needs a CUDA GPU")
        return 2
    variants = VARIANTS if args.set == "phases" else SOFTMAX_VARIANTS
    names = list(variants)
    points = default_points() if args.set == "phases" else softmax_points()
    # the phases are left out of the one-P loop (``mainloop_overlapped``, where "pack" applies),
    # whatever the default loop becomes
    pinned = dict(speculative_exp=False, p_buffers=1) if args.set == "phases" else {}
    configs = {(p, n): _config(p, {**pinned, **variants[n]}) for p in points for n in names}
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.workers) as pool:
        for took in pool.imap_unordered(_compile, sorted(set(configs.values()), key=repr)):
            print("compiled", took, flush=True)
    print(f"compiled {len(set(configs.values()))} kernels in {time.time() - t0:.0f} s", flush=True)

    rows = []
    for p in points:
        q, k, v, _ = _inputs(p, torch)
        problem = validate(q, k, v, **_mask_kwargs(p))
        out = q.new_empty(q.shape, dtype=problem.out_dtype)
        runners = {n: HopperRunner(configs[p, n], disk_cache.load_or_compile(configs[p, n], compile_kernel))
                   for n in names}
        times = {n: [] for n in names}
        for _ in range(args.rounds):
            for n in names:
                times[n].append(do_bench(lambda: runners[n](problem, q, k, v, out, None),
                                         warmup=50, rep=200, return_mode="median"))
        for n in names:
            ms = sorted(times[n])[len(times[n]) // 2]
            rows.append(dict(point=p.label(), variant=n, ms=ms, ms_rounds=times[n],
                             tflops=p.flops() / (ms * 1e-3) / 1e12))
        base = next(r["ms"] for r in rows if r["point"] == p.label() and r["variant"] == "default")
        print(p.label(), {r["variant"]: f"{r['tflops']:.0f} ({base / r['ms']:.3f})"
                          for r in rows if r["point"] == p.label()}, flush=True)

    os.makedirs(args.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                command="python scripts/phase_costs.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    with open(os.path.join(args.out, "phase_costs.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Phase costs ({meta['device']}, {meta['date']})", "",
             f"command: `{meta['command']}`", "",
             ("TFLOP/s, and in parentheses the speed-up over the default kernel when the phase is left "
              "out (wrong results: a bound on what speeding that phase up could buy)." if args.set == "phases"
              else "TFLOP/s, and in parentheses the speed-up over the library's default kernel."), "",
             "| point | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for p in points:
        by = {r["variant"]: r for r in rows if r["point"] == p.label()}
        base = by["default"]["ms"]
        lines.append(f"| {p.label()} | " + " | ".join(
            f"{by[n]['tflops']:.0f} ({base / by[n]['ms']:.2f})" for n in names) + " |")
    with open(os.path.join(args.out, "phase_costs.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
