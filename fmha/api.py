"""The public entry points: functional forward (dense and varlen; differentiable when an input
requires grad, through the custom ops of ``fmha.ops``), the functional backward, and the object
form modelled on cuDNN's graph API (construct from samples, check_support, compile, execute)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from . import dispatch, ops
from .backends import FORWARD, UnsupportedError, check_backend_name, runner_for, select, unsupported_reasons
from .mods import call_mods
from .options import parse_cached, with_public_options
from .problem import AttentionProblem
from .validation import kernel_options, validate

__all__ = ["attention", "attention_varlen", "attention_backward", "FusedAttention"]


def _needs_autograd(q, k, v, sinks=None) -> bool:
    """Whether the call must go through the custom ops: an input requires grad (and grad mode is
    on), torch.compile is tracing it, or it runs on meta or fake tensors or under a Python
    dispatch mode (FlopCounterMode...), which need the ops' fake implementations and FLOP
    formulas."""
    if not all(t is None or isinstance(t, torch.Tensor) for t in (q, k, v, sinks)):
        return False  # validation reports it
    if torch.compiler.is_compiling() or not ops.plain_eager_call(q, k, v, sinks):
        return True
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, sinks))


def _with_mods(options, aux, block_mask):
    """(options, ``CallMods`` or None) of a call; a block mask's own ``mask_mod`` joins the options
    when the call gives none (so the custom ops, which name it there, see it too)."""
    mods = call_mods(options, aux, block_mask)
    if mods is not None and mods.mask_mod is not options.mask_mod:
        options = dataclasses.replace(options, mask_mod=mods.mask_mod)
    return options, mods


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, *, varlen, max_seqlen_q, max_seqlen_k, sinks, return_lse, out, lse,
         out_dtype, backend, persistent, tile_mn, deterministic, options, aux=None, block_mask=None):
    options, mods = _with_mods(parse_cached(**options), aux, block_mask)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if _needs_autograd(q, k, v, sinks):
        if out is not None or lse is not None:
            raise ValueError("out= and lse= are not differentiable; leave them out when an input requires "
                             "grad (or call under torch.no_grad())")
        o, l = ops.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options=options, sinks=sinks,
                                     varlen=varlen, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                     out_dtype=out_dtype, backend=backend, persistent=persistent, tile_mn=tile_mn,
                                     deterministic=deterministic, mods=mods)
        return (o, l) if return_lse else o
    return dispatch.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options=options, sinks=sinks, varlen=varlen,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse, out=out,
                            lse=lse, out_dtype=out_dtype, backend=backend, persistent=persistent, tile_mn=tile_mn,
                            mods=mods)


@with_public_options
def attention(q, k, v, *, sinks=None, return_lse=False, out=None, lse=None, out_dtype=None, backend="auto",
              persistent=None, tile_mn=None, deterministic=False, aux=None, block_mask=None, **options):
    """Attention forward on BSHD tensors: q (B, S_q, H_q, D), k/v (B, S_k, H_k, D); a BHSD tensor
    is accepted as ``x.transpose(1, 2)``. Returns O (B, S_q, H_q, D_v) in ``out_dtype`` (default:
    the input dtype, bf16 for fp8), or ``(O, LSE)`` with LSE (B, H_q, S_q) fp32 when
    ``return_lse``. ``out``/``lse`` preallocated are written in place (``lse`` is filled even
    without ``return_lse``). ``sinks`` (H_q,) adds one logit per query head to every row's
    softmax denominator (gpt-oss). The mask, score and scale options (``causal``,
    ``window_size``, ``mask_align``, ``compressed_causal``, ``softmax_scale``, ``softcap``,
    ``scale_q/k/v``, ``inv_scale_o``) are defined once in ``fmha.options.parse``; semantics:
    docs/semantics.md. With inputs that require grad (``sinks`` too), autograd records the call;
    ``deterministic=True`` makes its backward bitwise-repeatable (the forward always is).
    ``score_mod``/``mask_mod`` (``fmha.mods``) read the tensors ``aux`` (a tensor or a tuple);
    ``block_mask`` (``fmha.create_block_mask``, or a FlexAttention BlockMask) lists the blocks to
    compute.
    """
    return _run(q, k, v, None, None, varlen=False, max_seqlen_q=None, max_seqlen_k=None, sinks=sinks,
                return_lse=return_lse, out=out, lse=lse, out_dtype=out_dtype, backend=backend,
                persistent=persistent, tile_mn=tile_mn, deterministic=deterministic, options=options, aux=aux,
                block_mask=block_mask)


@with_public_options
def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
                     seqused_k=None, block_table=None, sinks=None, return_lse=False, out=None, lse=None,
                     out_dtype=None, backend="auto", persistent=None, tile_mn=None, deterministic=False, aux=None,
                     **options):
    """Attention forward on packed THD tensors: q (T_q, H_q, D), k/v (T_k, H_k, D); sequence b is
    rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, length B + 1, on q's device). Masks apply per
    sequence. ``max_seqlen_*`` may be None (read from cu_seqlens). LSE is (H_q, T_q).
    Otherwise as :func:`attention`. cu_seqlens are checked on the host: one sync per cu_seqlens
    tensor and version, not per call (``fmha.validation``). Mods see each sequence's own
    positions (``q_idx``, ``kv_idx`` from 0) and its index as ``b``.

    Over a KV cache (a serving engine's mixed batch of chunked prefills and decodes): k/v are a
    paged cache (num_pages, page_size, H_k, D) with ``block_table`` (B, max_pages) int32, or a
    dense one (B, S_max, H_k, D); ``seqused_k`` (B,) int32 counts sequence b's keys (its new
    query rows' own keys included) and there is no ``cu_seqlens_k``. Masks are bottom-right
    aligned (``mask_align="top_left"`` is refused); not differentiable; no mods. This is
    ``fmha.attention_with_kvcache(q, k, v, seqused_k, cu_seqlens_q=..., block_table=...)``.
    """
    if seqused_k is not None or block_table is not None:
        return _varlen_over_cache(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                                  block_table, sinks=sinks, return_lse=return_lse, out=out, lse=lse,
                                  out_dtype=out_dtype, backend=backend, persistent=persistent, tile_mn=tile_mn,
                                  deterministic=deterministic, aux=aux, options=options)
    if cu_seqlens_k is None:
        raise TypeError("attention_varlen needs cu_seqlens_k for packed k/v (or seqused_k / block_table for a KV "
                        "cache)")
    return _run(q, k, v, cu_seqlens_q, cu_seqlens_k, varlen=True, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, sinks=sinks, return_lse=return_lse, out=out, lse=lse,
                out_dtype=out_dtype, backend=backend, persistent=persistent, tile_mn=tile_mn,
                deterministic=deterministic, options=options, aux=aux)


def _varlen_over_cache(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                       block_table, *, sinks, return_lse, out, lse, out_dtype, backend, persistent, tile_mn,
                       deterministic, aux, options):
    """``attention_varlen`` over a KV cache: checked here for what the cache path does not take,
    then run by ``fmha.attention_with_kvcache``."""
    from .kvcache import attention_with_kvcache

    # unknown or bad options raise here, as for every other call; an fp8 cache's tensor scales
    # are checked by the cache path
    parse_cached(**{name: 1.0 if name in ("scale_k", "scale_v") and isinstance(value, torch.Tensor) else value
                    for name, value in options.items()})
    if cu_seqlens_k is not None:
        raise ValueError("a KV cache's keys are counted by seqused_k, not cu_seqlens_k: pass cu_seqlens_k=None")
    if seqused_k is None:
        raise ValueError("block_table needs seqused_k, the (B,) int32 count of each sequence's keys in the cache")
    if options.get("mask_align", "bottom_right") != "bottom_right":
        raise ValueError("over a KV cache the query rows are each sequence's last: masks are bottom-right aligned; "
                         "leave mask_align out")
    unused = [name for name, value in (("compressed_causal", options.get("compressed_causal", False)),
                                       ("score_mod", options.get("score_mod")), ("mask_mod", options.get("mask_mod")),
                                       ("aux", aux), ("persistent", persistent), ("tile_mn", tile_mn))
              if value is not None and value is not False]
    if unused:
        raise ValueError(f"{', '.join(unused)}: not served over a KV cache (seqused_k / block_table)")
    if deterministic is not False and deterministic is not True:
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in (q, k_cache, v_cache, sinks)):
        raise ValueError("attention over a KV cache is not differentiable: call it under torch.no_grad(), or pass "
                         "packed k/v with cu_seqlens_k to train")
    if max_seqlen_k is not None and (isinstance(max_seqlen_k, bool) or not isinstance(max_seqlen_k, int)):
        raise TypeError(f"max_seqlen_k must be an int or None, got {max_seqlen_k!r}")  # a bound only: not used
    kwargs = {name: options[name] for name in ("causal", "window_size", "softmax_scale", "softcap", "scale_q",
                                               "scale_k", "scale_v", "inv_scale_o") if name in options}
    kwargs.setdefault("causal", False)  # attention_varlen's default, not the cache function's
    return attention_with_kvcache(q, k_cache, v_cache, seqused_k, block_table=block_table, cu_seqlens_q=cu_seqlens_q,
                                  max_seqlen_q=max_seqlen_q, sinks=sinks, return_lse=return_lse, out=out, lse=lse,
                                  out_dtype=out_dtype, backend=backend, **kwargs)


@with_public_options
def attention_backward(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                       max_seqlen_k=None, *, dlse=None, sinks=None, deterministic=False, dq=None, dk=None, dv=None,
                       dsinks=None, backend="auto", aux=None, block_mask=None, **options):
    """Gradients of attention with respect to q, k and v: ``(dq, dk, dv)`` in the dtypes and
    shapes of q, k, v (written into ``dq``/``dk``/``dv`` when given). ``out`` and ``lse`` are
    the forward's (``return_lse=True``), ``dout`` the gradient of ``out``, ``dlse`` (optional)
    that of ``lse``. Dense (BSHD) or, with ``cu_seqlens_q/k``, packed (THD) as in the forward,
    with the forward's options; ``deterministic=True`` asks for bitwise-repeatable gradients.
    With ``sinks``, returns ``(dq, dk, dv, dsinks)`` (written into ``dsinks`` when given).
    For frameworks that drive the backward themselves (ring attention); ``attention(...)`` with
    inputs that require grad records autograd on its own."""
    options, mods = _with_mods(parse_cached(**options), aux, block_mask)
    return dispatch.backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        options=options, dlse=dlse, sinks=sinks, deterministic=deterministic, dq=dq, dk=dk, dv=dv,
        dsinks=dsinks, backend=backend, mods=mods)


class FusedAttention:
    """Attention prepared once for a fixed configuration, run many times into preallocated
    outputs (cuDNN's / the seed's host API).

    The sample tensors fix everything but the data: dtypes, shapes, device, mask, scales,
    whether LSE is written, and for varlen B, T_q, T_k and the max sequence lengths (the
    cu_seqlens values may change between executions). Strides may differ if still valid.
    The samples are only inspected, not kept.

        fa = FusedAttention(q, k, v, o, causal=True)
        fa.check_support()   # True, or UnsupportedError listing why no kernel applies
        fa.compile()
        fa.execute(q, k, v, o)

    ``score_mod``/``mask_mod`` with their ``aux`` tensors and a ``block_mask`` are fixed at
    construction: every execution reads those same aux and captured tensors (update them in place
    to change what the mods see; with ``check=False`` they must keep their strides). A block mask
    is read once, at the first execution (its tile lists are kept): build a new one, and a new
    object, to change it.
    """

    @with_public_options
    def __init__(
        self, sample_q, sample_k, sample_v, sample_o, sample_lse=None, *,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, sinks=None,
        backend="auto", persistent=None, tile_mn=None, aux=None, block_mask=None, **options,
    ):
        check_backend_name(backend)
        self._varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self._options, self._mods = _with_mods(parse_cached(**options), aux, block_mask)
        self._sinks = sinks
        self.problem = self._validate(sample_q, sample_k, sample_v, sample_o, sample_lse,
                                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks)
        self.options = kernel_options(persistent, tile_mn)
        # execute(check=False) does not read cu_seqlens, so the sequence lengths are unknown:
        # the kernel then enumerates every query tile up to max_seqlen_q.
        self._problem_unread = dataclasses.replace(self.problem, seqlens_q=None, seqlens_k=None)
        self._backend_arg = backend
        self._backend = None
        self._runner = None

    def _validate(self, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, sinks) -> AttentionProblem:
        if o is None:
            raise TypeError("o must be a preallocated torch.Tensor")
        return validate(
            q, k, v, varlen=self._varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
            max_seqlen_q=max_q, max_seqlen_k=max_k, out=o, lse=lse, sinks=sinks, options=self._options,
            mods=self._mods,
        )

    @property
    def mods(self):
        """The ``fmha.mods.CallMods`` this object runs (None without mods)."""
        return self._mods

    @property
    def backend_name(self) -> Optional[str]:
        """What compile() chose ('reference' or a kernel backend's name); None before."""
        return None if self._backend is None else self._backend.name

    def check_support(self) -> bool:
        """True if a kernel runs this configuration (or backend='reference' was asked for);
        otherwise raise UnsupportedError with every reason."""
        if self._backend_arg == "reference":
            return True
        chosen, reasons = unsupported_reasons(self.problem, self.options)
        if chosen is None:
            raise UnsupportedError(reasons)
        return True

    def compile(self) -> "FusedAttention":
        """Choose the backend (falling back to the reference under 'auto') and prepare it."""
        self._backend = select(FORWARD, self._backend_arg, self.problem, self.options)
        self._runner = runner_for(FORWARD, self._backend, self.problem, self.options)
        return self

    def execute(self, q, k, v, o, lse=None, cu_seqlens_q=None, cu_seqlens_k=None, *, sinks=None,
                check: bool = True) -> None:
        """Write attention of q, k, v into ``o`` (and ``lse``); compiles on first use.

        ``check=False`` skips validating the tensors against the samples, and with it the
        host sync that varlen checks need (for timing loops and CUDA graph capture): the caller
        then vouches that they match, cu_seqlens values included."""
        if not check:
            if self._runner is None:
                self.compile()
            with dispatch.offsets_checked_on_device(self._problem_unread):
                self._runner(self._problem_unread, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks,
                             **dispatch.mod_kwargs(self._mods))
            return
        problem = self._validate(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                 self.problem.seqlen_q if self._varlen else None,
                                 self.problem.seqlen_k if self._varlen else None, sinks)
        # per-sequence lengths may change between executions (within the max lengths)
        diffs = [
            f"{f.name}: {getattr(problem, f.name)} (samples: {getattr(self.problem, f.name)})"
            for f in dataclasses.fields(problem)
            if f.name not in ("seqlens_q", "seqlens_k")
            and getattr(problem, f.name) != getattr(self.problem, f.name)
        ]
        if diffs:
            raise ValueError(
                "execute() tensors do not match the samples this FusedAttention was built for: "
                + "; ".join(diffs)
            )
        if self._runner is None:
            self.compile()
        with dispatch.offsets_checked_on_device(problem):
            self._runner(problem, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks, **dispatch.mod_kwargs(self._mods))
