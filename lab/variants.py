"""Benchmark variants: the library's Hopper kernel with one compile-time choice changed, timed
beside the default by ``python -m lab.bench --variants`` to measure what a choice buys
(``--backward --variants``: the backward kernel's variants, ``BACKWARD_VARIANTS``).

A variant overrides fields of ``HopperForwardConfig`` (tile, schedule, Q buffers, O store) or
its derived properties (softmax chains, lazy rescale); overridden properties live in a subclass
made here, so the library's config keeps only what production sets. Loops and knobs that were
measured and dropped are in git history, commit a67897b (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import re
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
    "fmha_fp8_n192": dict(tile_n=192, fp8_only=True, head_dims=(128,)),
    # fp8 at D=256 with the 64-key tile (8 K/V stages) it had before 128 keys were adopted
    "fmha_fp8_d256_n64": dict(tile_n=64, fp8_only=True, head_dims=(256,)),
    "fmha_fp8_d256_n96": dict(tile_n=96, fp8_only=True, head_dims=(256,)),  # 5 K/V stages beside O's buffer
}


#: keys of a ``VARIANTS`` entry that say where it is timed, not what it changes
_WHERE = ("fp8_only", "head_dims", "causal_only")
_FORWARD_CLASSES = {}  # (base class, pinned properties) -> config subclass


def _forward_variant_class(base: type, pinned: dict) -> type:
    """The subclass of ``base`` with ``pinned`` properties, a module attribute of its own name so
    that its configs pickle (the GPU check compiles them in worker processes)."""
    key = (base, tuple(sorted(pinned.items())))
    cls = _FORWARD_CLASSES.get(key)
    if cls is None:
        unknown = [k for k in pinned if not isinstance(getattr(base, k, None), property)]
        if unknown:
            raise ValueError(f"not a field or property of the config: {unknown}")
        name = re.sub(r"\W", "_", "HopperForwardConfig_" + "_".join(f"{k}_{v}" for k, v in key[1]))
        attrs = {k: property(lambda self, v=v: v) for k, v in pinned.items()}
        cls = _FORWARD_CLASSES[key] = type(name, (base,), dict(attrs, __module__=__name__, __qualname__=name))
        globals()[name] = cls
    return cls


def variant_config(cfg: HopperForwardConfig, **changes) -> HopperForwardConfig:
    """``cfg`` with fields replaced and derived properties pinned to the given values."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in changes.items() if k in fields})
    pinned = {k: v for k, v in changes.items() if k not in fields}
    if not pinned:
        return cfg
    return _forward_variant_class(type(cfg), pinned)(**{f: getattr(cfg, f) for f in fields})


def forward_variant_overrides(name: str) -> tuple:
    """(overrides, where: fp8_only, head_dims, causal_only) of forward variant ``name``."""
    spec = dict(VARIANTS[name])
    where = {k: spec.pop(k) for k in _WHERE if k in spec}
    return spec, where


def _why_not_timed(fp8: bool, head_dim: int, masked: bool, where: dict):
    """Why a forward variant with ``where`` (fp8_only, head_dims, causal_only) is not timed on a
    problem with these inputs, or None where it is."""
    fp8_only, head_dims = where.get("fp8_only", False), where.get("head_dims", ())
    if fp8_only != fp8:
        return f"this variant is timed on {'fp8' if fp8_only else 'bf16'} points"
    if head_dims and head_dim not in head_dims:
        return f"this variant is timed at head dims {head_dims}"
    if where.get("causal_only") and not masked:
        return "this variant changes the schedule of causal-like masks only"
    return None


def forward_variant_applies(cfg: HopperForwardConfig, where: dict) -> bool:
    """Whether a forward variant is timed (and checked) on ``cfg``'s problems."""
    import torch

    from fmha.masking import MaskKind

    return _why_not_timed(cfg.dtype == torch.float8_e4m3fn, cfg.head_dim, cfg.mask_kind != MaskKind.NONE,
                          where) is None


for _name in VARIANTS:  # every variant's class exists on import (unpickling looks it up)
    _pinned = {k: v for k, v in forward_variant_overrides(_name)[0].items()
               if k not in {f.name for f in dataclasses.fields(HopperForwardConfig)}}
    if _pinned:
        _forward_variant_class(HopperForwardConfig, _pinned)


def kernel_variant(mask_kwargs: Callable, fp8_only: bool = False, head_dims: tuple = (), causal_only: bool = False,
                   **overrides) -> Callable:
    """A benchmark implementation ``fn(q, k, v, point, cu_seqlens)``: the library's config for the
    point with ``overrides``, compiled once, called below the public API."""
    from fmha.kernels.hopper.forward_runner import HopperRunner, compile_forward
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    runners = {}  # config -> runner
    prepared = {}  # point -> (problem, runner): validated and configured once, not per timed call

    where = dict(fp8_only=fp8_only, head_dims=head_dims, causal_only=causal_only)

    def fn(q, k, v, p, cu):
        why = _why_not_timed(p.dtype != "bfloat16", p.head_dim, p.causal, where)
        if why:
            raise NotImplementedError(why)
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


# name -> overrides of HopperBackwardConfig's tile attributes, and the head dims timed
BACKWARD_VARIANTS = {
    # 64 query rows per step, dQ split by head dim: D=64's tile before 128 rows were adopted,
    # D=128's at every length (production takes 80 without a mask from LONG_ROWS query rows)
    "fmha_bwd_m64": dict(tile_m=64, dq_split_rows=False, head_dims=(64, 128)),
    # dK and dV by every thread's stores straight to global memory, as before D=128 staged them
    # for TMA stores
    "fmha_bwd_stg_dkv": dict(dkv_store_tma=False, head_dims=(128,)),
    # dK and dV TMA-stored at D=64 too (with the 128-row tile)
    "fmha_bwd_tma_dkv": dict(dkv_store_tma=True, head_dims=(64,)),
    # dK staged only after dV's TMA store has read V's buffer (the order before the overlap)
    "fmha_bwd_dkv_serial": dict(dk_staged_under_dv_store=False, head_dims=(128,)),
    # D=128: no branch between the exponentials and dS, so that ptxas interleaves them (it then
    # waits for dP^T first); ncu at S=1k causal: 1.4k samples of MUFU waits against FA4's 0.1k.
    # With dS stored after dV's product is issued: with it stored before, ptxas spills (10 at
    # D=128 non-causal), without, none
    "fmha_bwd_exp_interleave": dict(exps_before_dp_wait=False, ds_stored_before_dv=False, head_dims=(128,)),
    # D=128: 80 query rows per step at every length and with every mask (production: without a
    # mask from LONG_ROWS query rows)
    "fmha_bwd_m80": dict(tile_m=80, head_dims=(128,)),
    # dS^T stored after dV's product is issued, the order before (D=64 spilled with the stores
    # first while the dQ accumulator was row-major)
    "fmha_bwd_ds_after_dv": dict(ds_stored_before_dv=False, head_dims=(64, 128)),
    # the dense grid in its own order (K/V tile fastest) where production launches the costliest
    # K/V tiles first (causal, a few waves: config.costliest_first_pays), and the reverse
    "fmha_bwd_tile_fastest": dict(kv_tiles_costliest_first=False),
    "fmha_bwd_costliest_first": dict(kv_tiles_costliest_first=True),
}


_BACKWARD_CLASSES = {}  # overrides -> config subclass (one per variant: configs compare by class)


def _backward_variant_class(**overrides):
    """The config subclass with ``overrides`` as class attributes (they shadow the config's
    properties of the same names), a module attribute of its own name so that it pickles (the
    GPU check compiles configurations in worker processes)."""
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig

    key = tuple(sorted(overrides.items()))
    cls = _BACKWARD_CLASSES.get(key)
    if cls is None:
        choices = ("tile_m", "tile_n", "dq_split_rows", "dkv_store_tma", "dk_staged_under_dv_store",
                   "exps_before_dp_wait", "ds_stored_before_dv")
        unknown = [k for k in overrides if k not in choices]
        if unknown:
            raise ValueError(f"not a tile choice of the backward config: {unknown}; variants set {', '.join(choices)}")
        name = "HopperBackwardConfig_" + "_".join(f"{k}_{v}" for k, v in key)
        cls = _BACKWARD_CLASSES[key] = type(name, (HopperBackwardConfig,), dict(overrides, __module__=__name__,
                                                                                __qualname__=name))
        globals()[name] = cls
    return cls


def backward_variant_config(cfg, **overrides):
    """``cfg`` (a HopperBackwardConfig) with its tile choices (tiles, dQ split, dK/dV stores)
    replaced, as a subclass of HopperBackwardConfig (not of ``type(cfg)``: variants do not stack;
    list every override in one)."""
    fields = {f.name for f in dataclasses.fields(cfg)}
    cls = _backward_variant_class(**{k: v for k, v in overrides.items() if k not in fields})
    return cls(**{f: overrides.get(f, getattr(cfg, f)) for f in fields})


def backward_variant_overrides(name: str) -> tuple:
    """(overrides, head dims it applies to: () for all) of backward variant ``name``."""
    overrides = dict(BACKWARD_VARIANTS[name])
    return overrides, tuple(overrides.pop("head_dims", ()))


def _backward_fields() -> set:
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig

    return {f.name for f in dataclasses.fields(HopperBackwardConfig)}


for _name in BACKWARD_VARIANTS:  # every variant's class exists on import (unpickling looks it up)
    _backward_variant_class(**{k: v for k, v in backward_variant_overrides(_name)[0].items()
                               if k not in _backward_fields()})


def backward_variant(mask_kwargs: Callable, head_dims: tuple = (), **overrides) -> Callable:
    """A benchmark implementation ``fn(q, k, v, point, cu_seqlens)`` whose output's backward runs
    the library's backward kernel with ``overrides`` (the forward is the library's)."""
    import torch

    import fmha
    from fmha.kernels.hopper.backward_runner import HopperBackwardRunner, compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate_backward

    runners = {}  # config -> runner

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, p, cu):
            kw = mask_kwargs(p)
            if p.varlen:
                out, lse = fmha.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="kernel", **kw)
            else:
                out, lse = fmha.attention(q, k, v, return_lse=True, backend="kernel", **kw)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.point, ctx.cu = p, cu
            return out

        @staticmethod
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            p, cu = ctx.point, ctx.cu
            varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(p.varlen),
                          max_seqlen_k=max(p.varlen)) if p.varlen else {}
            dout = dout.contiguous()
            problem = validate_backward(dout, q, k, v, out, lse, varlen=bool(p.varlen), **varlen, **mask_kwargs(p))
            base = HopperBackwardConfig.from_problem(problem, KernelOptions())
            cfg = backward_variant_config(base, **overrides)
            if cfg not in runners:
                runners[cfg] = HopperBackwardRunner(cfg, compile_backward(cfg))
            grads = [torch.empty_like(t) for t in (q, k, v)]
            runners[cfg](problem, dout, q, k, v, out, lse, None, *grads, cu, cu)
            return (*grads, None, None)

    def fn(q, k, v, p, cu):
        if head_dims and p.head_dim not in head_dims:
            raise NotImplementedError(f"this variant is timed at head dims {head_dims}")
        return Attention.apply(q, k, v, p, cu)

    return fn
