"""Where a training step's time goes (GPU): each kernel's time per step against the step's wall time.

    python -m lab.profile_step --filter "varlen19 T16384 max3566 H16/16 D128 causal" --impls fmha,fa4
    python -m lab.profile_step --backward --filter "B32 S512 H32/32 D64 causal" --impls fmha,fa4  # the backward alone
    python -m lab.profile_step --forward --filter "B4 S4096 H16/16 D128 fp8" --impls fmha  # the forward alone

For every benchmark point the filter selects (``lab/bench.py``'s full grid) and each implementation,
the step ``lab.bench --step`` times (forward + ``autograd.grad``) runs under ``torch.profiler``:
the table lists the kernels by GPU time per step. When the kernels' sum is well below the wall time
the step waits on the host (launch overhead or a sync), not on a kernel.
"""

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def profile_point(fn, torch, steps: int = 20) -> str:
    from torch.profiler import ProfilerActivity, profile

    import time

    warm_until = time.perf_counter() + 0.5  # clocks up, as do_bench's warmup has them
    while time.perf_counter() < warm_until:
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    wall_us = start.elapsed_time(end) * 1e3 / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name][0] += 1
            per_kernel[e.name][1] += e.device_time
    total = sum(t for _, t in per_kernel.values()) / steps
    lines = [f"wall {wall_us:.0f} us/step, kernels {total:.0f} us/step ({total / wall_us:.0%} of the wall)",
             "| kernel | launches/step | us/step |", "|---|---|---|"]
    for name, (n, t) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {short_kernel_name(name)} | {n / steps:g} | {t / steps:.1f} |")
    return "\n".join(lines)


def short_kernel_name(name: str, width: int = 70) -> str:
    """A CuTe DSL kernel's module path and class (``kernel_cutlass_kernel_fmhakernelshopperfwd
    HopperAttentionForward_object_at__TiledMMA...`` -> ``fmhakernelshopperfwdHopperAttentionForward``),
    so that a table row stays short enough to read whole; other names cut at ``width``."""
    name = name.removeprefix("kernel_cutlass_kernel_")
    return name.split("_object_at_")[0][:width]


def host_profile(fn, torch, steps: int, top: int = 25) -> str:
    """The host's own time per function over ``steps`` steps (the GPU is kept busy, not waited on)."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    for order in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(top)
    return "\n".join(line[:160] for line in text.getvalue().splitlines() if line.strip())


def main(argv=None):
    import torch

    from lab.bench import SMALL_CASES, _implementations, _inputs, build_grid

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--filter", required=True, help="points whose label contains this ('|' separates alternatives; a trailing '$' means the label ends with it)")
    ap.add_argument("--impls", default="fmha,fa4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--host", action="store_true", help="also the host's Python profile of the steps (cProfile, by own time)")
    ap.add_argument("--backward", action="store_true",
                    help="the backward alone (autograd.grad of one forward's output), as `lab.bench --backward` times it")
    ap.add_argument("--forward", action="store_true",
                    help="the forward alone (no autograd), as `lab.bench` times it; fp8 points too")
    ap.add_argument("--variants", action="store_true", help="also the lab variants (lab/variants.py) as --impls")
    args = ap.parse_args(argv)
    impls = _implementations(torch, variants=args.variants)
    wanted = args.filter.split("|")
    for p in build_grid("full") + [p for mode, p in SMALL_CASES if mode == "step"]:
        if not any(p.label().endswith(w[:-1]) if w.endswith("$") else w in p.label() for w in wanted):
            continue
        q, k, v, cu = _inputs(p, torch)
        if not args.forward:
            dout = torch.randn(q.shape, device=q.device).to(q.dtype)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        for name in args.impls.split(","):
            if name not in impls:
                print(f"\n## {name}: not available here")
                continue
            try:
                if args.forward:
                    fn = (lambda f=impls[name]: f(q, k, v, p, cu))
                elif args.backward:  # one forward; each step is its backward
                    out = impls[name](*leaves, p, cu)
                    fn = (lambda out=out: torch.autograd.grad(out, leaves, dout, retain_graph=True))
                else:
                    fn = (lambda f=impls[name]: torch.autograd.grad(f(*leaves, p, cu), leaves, dout))
                print(f"\n## {name}: {p.label()}\n\n{profile_point(fn, torch, args.steps)}", flush=True)
            except (NotImplementedError, TypeError) as e:  # TypeError: fp8 has no backward
                print(f"\n## {name}: {p.label()}: n/a ({e})")
                continue
            if args.host:
                print(host_profile(fn, torch, args.steps), flush=True)


if __name__ == "__main__":
    main()
