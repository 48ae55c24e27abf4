"""One validated, dispatched call: validation (``fmha.validation``), the backend and its runner
(``fmha.backends``), the outputs allocated, the launch; and the memo that lets a repeated call
skip validation and dispatch. ``fmha.api`` (the public functions) and ``fmha.ops`` (the custom
ops under autograd and torch.compile) both call here, so neither imports the other."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from . import device_errors
from .backends import BACKWARD, FORWARD, check_backend_name, recall_dispatch, remember_dispatch, runner_for, select
from .options import AttentionOptions
from .problem import AttentionProblem, accumulate_dtype
from .validation import (ALIGN_BYTES, kernel_options, lse_shape, offsets_read_record, out_shape, validate,
                         validate_backward)


def _allocate(q: torch.Tensor, problem: AttentionProblem, out, lse):
    if out is None:
        out = torch.empty(out_shape(q, problem.head_dim_v), dtype=problem.out_dtype,
                          device=q.device)
    if lse is None and problem.return_lse:
        lse = torch.empty(lse_shape(q, problem.varlen), dtype=accumulate_dtype(q.dtype), device=q.device)
    return out, lse


_PLAIN = (int, float, bool, str, type(None), torch.dtype, AttentionOptions)


def memo_key(tensors, args):
    """Key of a call for ``recall_dispatch`` (its tensors' metadata and its plain arguments), or
    None when an argument is not a plain value (a tensor scale, a list window...) or a tensor's
    place holds something else: those take the full path, which also reports them."""
    for a in args:
        if type(a) not in _PLAIN and not (type(a) is tuple and all(type(e) in _PLAIN for e in a)):
            return None
    meta = []
    for t in tensors:  # a loop, not generators: this runs on every call of a decode loop
        if t is None:
            meta.append(None)
        elif isinstance(t, torch.Tensor):
            meta.append((t.dtype, t.device, t.shape, t.stride()))
        else:
            return None
    meta = tuple(meta)
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
    key = memo_key(tensors, args)
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


def pointers_aligned(tensors) -> bool:
    for t in tensors:
        if t is not None and t.data_ptr() % ALIGN_BYTES:
            return False
    return True


def _mod_tensors(mods) -> tuple:
    """The tensors of a call's mods whose metadata the memo keys."""
    if mods is None:
        return ()
    return mods.all_tensors()


def _mods_layout(mods):
    """What the memo keys beside those tensors: how many are aux and whether the last is a block
    mask's states (an aux tensor of the same metadata must not reuse the plan)."""
    return None if mods is None else (len(mods.aux), mods.block_mask is not None)


def mod_kwargs(mods) -> dict:
    """Runners that serve mods take them as ``mods=``; the others are never chosen for them."""
    return {} if mods is None else {"mods": mods}


def forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, options: AttentionOptions, sinks, varlen, max_seqlen_q,
            max_seqlen_k, return_lse, out, lse, out_dtype, backend, persistent, tile_mn, mods=None):
    """Validate, dispatch and run one forward call (no autograd). ``mods``: the call's
    ``fmha.mods.CallMods`` (None: made from the options where they have mods)."""
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if varlen else ()
    mods = _call_mods(options, mods)
    key, hit = _recall((q, k, v, out, lse, sinks) + _mod_tensors(mods),
                       (options, _mods_layout(mods), return_lse, out_dtype, backend, persistent, tile_mn, varlen,
                        max_seqlen_q, max_seqlen_k), cu_seqlens)
    if hit is not None and pointers_aligned((q, k, v, out)):
        problem, runner = hit
        out, lse = _allocate(q, problem, out, lse)
        with offsets_checked_on_device(problem):
            runner(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, **mod_kwargs(mods))
        return (out, lse) if return_lse else out
    check_backend_name(backend)
    problem = validate(
        q, k, v, varlen=varlen, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=return_lse,
        out=out, lse=lse, out_dtype=out_dtype, options=options, sinks=sinks, mods=mods,
    )
    kernel = kernel_options(persistent, tile_mn)
    out, lse = _allocate(q, problem, out, lse)
    chosen = select(FORWARD, backend, problem, kernel)
    runner = runner_for(FORWARD, chosen, problem, kernel)
    _remember(key, problem, runner, cu_seqlens)
    with offsets_checked_on_device(problem):
        runner(problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks, **mod_kwargs(mods))
    return (out, lse) if return_lse else out


def _call_mods(options: AttentionOptions, mods):
    if mods is None and (options.score_mod is not None or options.mask_mod is not None):
        from .mods import call_mods

        return call_mods(options)
    return mods


@contextlib.contextmanager
def offsets_checked_on_device(problem):
    """Around a varlen launch whose offsets the host did not read (``fmha.device_errors``)."""
    unread = problem.varlen and problem.seqlens_q is None and problem.device.type == "cuda"
    if unread:
        device_errors.raise_pending(problem.device)
    yield
    if unread:
        device_errors.watch(problem.device)


def backward(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, *,
             options: AttentionOptions, dlse=None, sinks=None, deterministic=False, dq=None, dk=None, dv=None,
             dsinks=None, backend="auto", mods=None):
    """Validate, dispatch and run one backward call (``fmha.attention_backward``'s arguments)."""
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    mods = _call_mods(options, mods)
    tensors = (dout, q, k, v, out, lse, dlse, dq, dk, dv, sinks, dsinks) + _mod_tensors(mods)
    cu_seqlens = (cu_seqlens_q, cu_seqlens_k) if varlen else ()
    # a training loop repeats its calls: validation and dispatch are reused as the forward's are
    key, hit = _recall(tensors, ("backward", options, _mods_layout(mods), deterministic, backend, varlen, max_seqlen_q,
                                 max_seqlen_k),
                       cu_seqlens)
    if hit is not None and pointers_aligned((dout, q, k, v, out, dq, dk, dv)):
        problem, runner = hit
    else:
        check_backend_name(backend)
        problem = validate_backward(
            dout, q, k, v, out, lse, dlse=dlse, dq=dq, dk=dk, dv=dv, dsinks=dsinks, varlen=varlen,
            cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k, options=options, sinks=sinks, mods=mods,
        )
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        kernel = dataclasses.replace(kernel_options(), deterministic=deterministic)
        chosen = select(BACKWARD, backend, problem, kernel)
        runner = runner_for(BACKWARD, chosen, problem, kernel)
        _remember(key, problem, runner, cu_seqlens)
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    if sinks is not None and dsinks is None:
        dsinks = torch.empty_like(sinks)
    with offsets_checked_on_device(problem):
        runner(problem, dout, q, k, v, out, lse, dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, deterministic,
               sinks, dsinks, **mod_kwargs(mods))
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
