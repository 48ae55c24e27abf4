"""The public entry points: functional forward (dense and varlen; differentiable when an input
requires grad, through the custom ops of ``fmha.ops``), the functional backward, and the object
form modelled on cuDNN's graph API (construct from samples, check_support, compile, execute)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from .backends import (
    UnsupportedError,
    check_backend_name,
    get_backward_runner,
    get_runner,
    recall_dispatch,
    remember_dispatch,
    select_backend,
    select_backward_backend,
    unsupported_reasons,
)
from . import device_errors
from .problem import AttentionProblem, accumulate_dtype
from .validation import (ALIGN_BYTES, kernel_options, lse_shape, offsets_read_record, out_shape, validate,
                         validate_backward)

__all__ = ["attention", "attention_varlen", "attention_backward", "FusedAttention"]


def _allocate(q: torch.Tensor, problem: AttentionProblem, out, lse):
    if out is None:
        out = torch.empty(out_shape(q, problem.head_dim_v), dtype=problem.out_dtype,
                          device=q.device)
    if lse is None and problem.return_lse:
        lse = torch.empty(lse_shape(q, problem.varlen), dtype=accumulate_dtype(q.dtype), device=q.device)
    return out, lse


_PLAIN = (int, float, bool, str, type(None), torch.dtype)


def _memo_key(tensors, args):
    """Key of a call for ``recall_dispatch`` (its tensors' metadata and its plain arguments), or
    None when an argument is not a plain value (a tensor scale, a list window...): those take the
    full path, which also reports them."""
    for a in args:
        if type(a) not in _PLAIN and not (type(a) is tuple and all(type(e) in _PLAIN for e in a)):
            return None
    meta = tuple(None if t is None else (t.dtype, t.device, t.shape, t.stride()) for t in tensors)
    # types too: True and 1 are equal keys, but validation may accept only one of them
    return meta + args + tuple(map(type, args))


def _recall(tensors, args, cu_seqlens=()):
    """(key to remember the call under, (problem, runner) remembered for it or None).

    Varlen calls key their offsets tensors' metadata too. A problem validated without reading
    the offsets (``max_seqlen_*`` given on a GPU) holds for any offsets of that metadata. One
    that read them holds only while they are the very read it was validated on: its entry keeps
    the read's records (``offsets_read_record``), and an in-place change, a new tensor (even one
    at a reused address) or another call's re-read replaces them. A call with an argument in a
    tensor's place that is not one gets no key (validation reports it)."""
    tensors = tuple(tensors) + tuple(cu_seqlens)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return None, None
    key = _memo_key(tensors, args)
    if key is None:
        return None, None
    hit = recall_dispatch(key)
    if hit is not None or not cu_seqlens:
        return key, hit
    guard = _offsets_read_guard(cu_seqlens)
    return key, (None if guard is None else recall_dispatch(key + ("offsets read",), guard))


def _remember(key, problem, runner, cu_seqlens=()):
    """Remember a validated call under its ``_recall`` key; a varlen one that read its offsets
    with the records of that read."""
    if key is None:
        return
    if cu_seqlens and (problem.seqlens_q is not None or problem.seqlens_k is not None):
        guard = _offsets_read_guard(cu_seqlens)
        if guard is not None:  # inference tensors are read every call
            remember_dispatch(key + ("offsets read",), problem, runner, guard)
        return
    remember_dispatch(key, problem, runner)


def _offsets_read_guard(cu_seqlens) -> Optional[tuple]:
    """The records of the current host reads of each offsets tensor (``offsets_read_record``), or
    None when one of them has none."""
    guard = tuple(offsets_read_record(cu) for cu in cu_seqlens)
    return None if any(record is None for record in guard) else guard


def _pointers_aligned(tensors) -> bool:
    return all(t is None or t.data_ptr() % ALIGN_BYTES == 0 for t in tensors)


def _needs_autograd(q, k, v, sinks=None) -> bool:
    """Whether the call must go through the custom ops: an input requires grad (and grad mode is
    on), or torch.compile is tracing it."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, sinks))


def _run(q, k, v, cu_seqlens_q, cu_seqlens_k, *, varlen, max_seqlen_q, max_seqlen_k,
         return_lse, out, lse, out_dtype, backend, persistent, tile_mn, deterministic, **mask_and_scales):
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    if _needs_autograd(q, k, v, mask_and_scales.get("sinks")):
        from . import ops

        if out is not None or lse is not None:
            raise ValueError("out= and lse= are not differentiable; leave them out when an input requires "
                             "grad (or call under torch.no_grad())")
        o, l = ops.attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, varlen=varlen, max_seqlen_q=max_seqlen_q,
                                     max_seqlen_k=max_seqlen_k, out_dtype=out_dtype, backend=backend,
                                     persistent=persistent, tile_mn=tile_mn, deterministic=deterministic,
                                     **mask_and_scales)
        return (o, l) if return_lse else o
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, varlen=varlen, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, return_lse=return_lse, out=out, lse=lse, out_dtype=out_dtype,
                    backend=backend, persistent=persistent, tile_mn=tile_mn, **mask_and_scales)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, varlen, max_seqlen_q, max_seqlen_k,
             return_lse, out, lse, out_dtype, backend, persistent, tile_mn, **mask_and_scales):
    """Validate, dispatch and run one forward call (no autograd)."""
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if varlen else ()
    sinks = mask_and_scales.get("sinks")
    plain = tuple(v for n, v in mask_and_scales.items() if n != "sinks")
    key, hit = _recall((q, k, v, out, lse, sinks), (return_lse, out_dtype, backend, persistent, tile_mn, varlen,
                                                    max_seqlen_q, max_seqlen_k) + plain, cu_seqlens)
    if hit is not None and _pointers_aligned((q, k, v, out)):
        problem, runner = hit
        out, lse = _allocate(q, problem, out, lse)
        with _offsets_checked_on_device(problem):
            runner(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
        return (out, lse) if return_lse else out
    check_backend_name(backend)
    problem = validate(
        q, k, v, varlen=varlen, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse,
        out=out, lse=lse, out_dtype=out_dtype, **mask_and_scales,
    )
    options = kernel_options(persistent, tile_mn)
    out, lse = _allocate(q, problem, out, lse)
    chosen = select_backend(backend, problem, options)
    runner = get_runner(chosen, problem, options)
    _remember(key, problem, runner, cu_seqlens)
    with _offsets_checked_on_device(problem):
        runner(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks)
    return (out, lse) if return_lse else out


@contextlib.contextmanager
def _offsets_checked_on_device(problem):
    """Around a varlen launch whose offsets the host did not read (``fmha.device_errors``)."""
    unread = problem.varlen and problem.seqlens_q is None and problem.device.type == "cuda"
    if unread:
        device_errors.raise_pending(problem.device)
    yield
    if unread:
        device_errors.watch(problem.device)


def attention(
    q, k, v, *,
    causal=False, window_size=(None, None), mask_align="top_left", compressed_causal=False,
    softmax_scale=None, softcap=0.0, sinks=None, scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0,
    return_lse=False, out=None, lse=None, out_dtype=None,
    backend="auto", persistent=None, tile_mn=None, deterministic=False,
):
    """Attention forward on BSHD tensors: q (B, S_q, H_q, D), k/v (B, S_k, H_k, D); a BHSD tensor
    is accepted as ``x.transpose(1, 2)``. Returns O (B, S_q, H_q, D) in ``out_dtype`` (default:
    the input dtype, bf16 for fp8), or ``(O, LSE)`` with LSE (B, H_q, S_q) fp32 when
    ``return_lse``. ``out``/``lse`` preallocated are written in place (``lse`` is filled even
    without ``return_lse``). Semantics: docs/semantics.md; ``window_size`` sides are ints or None
    (unbounded) and may be negative (a band offset: ``(None, -5)`` keeps keys at least five
    positions back); ``causal=True`` with a window clips its right side to 0. ``softcap`` > 0 caps
    the scaled scores at ``softcap * tanh(s / softcap)``; ``sinks`` (H_q,) adds one logit per query
    head to every row's softmax denominator (gpt-oss). With inputs that require grad (``sinks``
    too), autograd records the call; ``deterministic=True`` makes its backward bitwise-repeatable
    (the forward always is).
    """
    return _run(
        q, k, v, None, None, varlen=False, max_seqlen_q=None, max_seqlen_k=None,
        causal=causal, window_size=window_size, mask_align=mask_align,
        compressed_causal=compressed_causal, softmax_scale=softmax_scale, softcap=softcap, sinks=sinks,
        scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, inv_scale_o=inv_scale_o, return_lse=return_lse,
        out=out, lse=lse, out_dtype=out_dtype, backend=backend, persistent=persistent,
        tile_mn=tile_mn, deterministic=deterministic,
    )


def attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *,
    causal=False, window_size=(None, None), mask_align="top_left", compressed_causal=False,
    softmax_scale=None, softcap=0.0, sinks=None, scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0,
    return_lse=False, out=None, lse=None, out_dtype=None,
    backend="auto", persistent=None, tile_mn=None, deterministic=False,
):
    """Attention forward on packed THD tensors: q (T_q, H_q, D), k/v (T_k, H_k, D); sequence b is
    rows ``cu_seqlens[b]:cu_seqlens[b + 1]`` (int32, length B + 1, on q's device). Masks apply per
    sequence. ``max_seqlen_*`` may be None (read from cu_seqlens). LSE is (H_q, T_q).
    Otherwise as :func:`attention`. cu_seqlens are checked on the host: one sync per cu_seqlens
    tensor and version, not per call (``fmha.validation``).
    """
    return _run(
        q, k, v, cu_seqlens_q, cu_seqlens_k, varlen=True, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        causal=causal, window_size=window_size, mask_align=mask_align,
        compressed_causal=compressed_causal, softmax_scale=softmax_scale, softcap=softcap, sinks=sinks,
        scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, inv_scale_o=inv_scale_o, return_lse=return_lse,
        out=out, lse=lse, out_dtype=out_dtype, backend=backend, persistent=persistent,
        tile_mn=tile_mn, deterministic=deterministic,
    )


def attention_backward(
    dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
    dlse=None, causal=False, window_size=(None, None), mask_align="top_left", compressed_causal=False,
    softmax_scale=None, softcap=0.0, sinks=None, scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0,
    deterministic=False, dq=None, dk=None, dv=None, dsinks=None, backend="auto",
):
    """Gradients of attention with respect to q, k and v: ``(dq, dk, dv)`` in the dtypes and
    shapes of q, k, v (written into ``dq``/``dk``/``dv`` when given). ``out`` and ``lse`` are
    the forward's (``return_lse=True``), ``dout`` the gradient of ``out``, ``dlse`` (optional)
    that of ``lse``. Dense (BSHD) or, with ``cu_seqlens_q/k``, packed (THD) as in the forward,
    with the forward's keywords; ``deterministic=True`` asks for bitwise-repeatable gradients.
    With ``sinks``, returns ``(dq, dk, dv, dsinks)`` (written into ``dsinks`` when given).
    For frameworks that drive the backward themselves (ring attention); ``attention(...)`` with
    inputs that require grad records autograd on its own."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    tensors = (dout, q, k, v, out, lse, dlse, dq, dk, dv, sinks, dsinks)
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if varlen else ()
    # a training loop repeats its calls: validation and dispatch are reused as the forward's are
    key, hit = _recall(tensors, ("backward", causal, window_size, mask_align, compressed_causal, softmax_scale,
                                 softcap, scale_q, scale_k, scale_v, inv_scale_o, deterministic, backend, varlen,
                                 max_seqlen_q, max_seqlen_k), cu_seqlens)
    if hit is not None and _pointers_aligned((dout, q, k, v, out, dq, dk, dv)):
        problem, runner = hit
    else:
        check_backend_name(backend)
        problem = validate_backward(
            dout, q, k, v, out, lse, dlse=dlse, dq=dq, dk=dk, dv=dv, dsinks=dsinks, varlen=varlen,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, causal=causal, window_size=window_size, mask_align=mask_align,
            compressed_causal=compressed_causal, softmax_scale=softmax_scale, softcap=softcap, sinks=sinks,
            scale_q=scale_q, scale_k=scale_k, scale_v=scale_v, inv_scale_o=inv_scale_o,
        )
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        options = dataclasses.replace(kernel_options(), deterministic=deterministic)
        chosen = select_backward_backend(backend, problem, options)
        runner = get_backward_runner(chosen, problem, options)
        _remember(key, problem, runner, cu_seqlens)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if sinks is not None and dsinks is None:
        dsinks = torch.empty_like(sinks)
    with _offsets_checked_on_device(problem):
        runner(problem, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, deterministic,
               sinks, dsinks)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)


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
    """

    def __init__(
        self, sample_q, sample_k, sample_v, sample_o, sample_lse=None, *,
        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
        causal=False, window_size=(None, None), mask_align="top_left", compressed_causal=False,
        softmax_scale=None, softcap=0.0, sinks=None, scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0,
        backend="auto", persistent=None, tile_mn=None,
    ):
        check_backend_name(backend)
        self._varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
        self._kwargs = dict(
            causal=causal, window_size=window_size, mask_align=mask_align,
            compressed_causal=compressed_causal, softmax_scale=softmax_scale, softcap=softcap, scale_q=scale_q,
            scale_k=scale_k, scale_v=scale_v, inv_scale_o=inv_scale_o,
        )
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
            max_seqlen_q=max_q, max_seqlen_k=max_k, out=o, lse=lse, sinks=sinks, **self._kwargs,
        )

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
        self._backend = select_backend(self._backend_arg, self.problem, self.options)
        self._runner = get_runner(self._backend, self.problem, self.options)
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
            with _offsets_checked_on_device(self._problem_unread):
                self._runner(self._problem_unread, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks)
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
        with _offsets_checked_on_device(problem):
            self._runner(problem, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, sinks)
