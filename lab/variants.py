"""Benchmark variants: the library's Hopper kernel with one compile-time choice changed, timed
beside the default by ``python -m lab.bench --variants`` to measure what a choice buys.

A variant overrides fields of ``HopperForwardConfig`` (tile, schedule, Q buffers, O store) or
its derived properties (softmax chains, lazy rescale); overridden properties live in a subclass
made here, so the library's config keeps only what production sets. Loops and knobs that were
measured and dropped are in git history, tag ``kernel-experiments`` (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from fmha.kernels.hopper.config import HopperForwardConfig, OStore, Schedule

# name -> overrides (config fields or properties) and which points the variant is timed on
VARIANTS = {
    "fmha_same_path": dict(),  # the default kernel, called like the variants (no validation per call)
    "fmha_fp8_same_path": dict(fp8_only=True),
    "fmha_one_cta_per_tile": dict(schedule=Schedule.ONE_CTA_PER_TILE, q_stages=1),
    "fmha_persistent": dict(schedule=Schedule.PERSISTENT),  # the static walk, where the library claims
    "fmha_claim": dict(schedule=Schedule.CLAIMED, causal_only=True),  # claiming where it walks statically
    "fmha_q1": dict(q_stages=1),  # the next tile's Q loads after this one's mainloop
    "fmha_direct_o": dict(o_store=OStore.DIRECT),  # O stored from registers
    "fmha_tile128": dict(tile_m=128, head_dims=(32, 64)),  # two consumer warpgroups at small heads
    "fmha_n192": dict(tile_n=192, head_dims=(128,)),  # a wider key tile
    "fmha_chain_softmax": dict(softmax_chains=(1, 1)),  # one dependent max/sum chain per row
    "fmha_tree_softmax": dict(softmax_chains=(4, 2)),  # four max / two sum chains per row
    "fmha_eager_rescale": dict(lazy_rescale=False),  # the exact running max, O rescaled every tile
    "fmha_fp8_n192": dict(tile_n=192, fp8_only=True),
}


def variant_config(cfg: HopperForwardConfig, **changes) -> HopperForwardConfig:
    """``cfg`` with fields replaced and derived properties pinned to the given values."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if k in fields})
    pinned = {k: v for k, v in changes.items() if k not in fields}
    if not pinned:
        return cfg
    unknown = [k for k in pinned if not isinstance(getattr(type(cfg), k, None), property)]
    if unknown:
        raise ValueError(f"not a field or property of the config: {unknown}")
    name = "HopperForwardConfig_" + "_".join(f"{k}_{v}" for k, v in sorted(pinned.items()))
    cls = type(name, (type(cfg),), {k: property(lambda self, v=v: v) for k, v in pinned.items()})
    return cls(**{f: getattr(cfg, f) for f in fields})


def kernel_variant(mask_kwargs: Callable, fp8_only: bool = False, head_dims: tuple = (), causal_only: bool = False,
                   **overrides) -> Callable:
    """A benchmark implementation ``fn(q, k, v, point, cu_seqlens)``: the library's config for the
    point with ``overrides``, compiled once, called below the public API."""
    from fmha.kernels.hopper.backend import HopperRunner, compile_forward
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    runners = {}  # config -> runner
    prepared = {}  # point -> (problem, runner): validated and configured once, not per timed call

    def fn(q, k, v, p, cu):
        if (p.dtype == "bfloat16") == fp8_only:
            raise NotImplementedError(f"this variant is timed on {'fp8' if fp8_only else 'bf16'} points")
        if head_dims and p.head_dim not in head_dims:
            raise NotImplementedError(f"this variant is timed at head dims {head_dims}")
        if causal_only and not p.causal:
            raise NotImplementedError("this variant changes the schedule of causal-like masks only")
        if p not in prepared:  # a varlen check reads cu_seqlens on the host
            kw = dict(varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(p.varlen),
                      max_seqlen_k=max(p.varlen)) if p.varlen else {}
            problem = validate(q, k, v, **kw, **mask_kwargs(p))
            cfg = variant_config(HopperForwardConfig.from_problem(problem, KernelOptions()), **overrides)
            if cfg not in runners:
                runners[cfg] = HopperRunner(cfg, compile_forward(cfg))
            prepared[p] = (problem, runners[cfg])
        problem, runner = prepared[p]
        out = q.new_empty(q.shape, dtype=problem.out_dtype)
        runner(problem, q, k, v, out, None, cu, cu)
        return out

    return fn
