"""Choosing what runs a validated problem: a GPU kernel backend, or the PyTorch reference.

A kernel backend is any object with

- ``name: str``
- ``capabilities``: the CUDA compute capabilities ((major, minor) pairs) it runs on
- ``why_unsupported(problem, options) -> list[str]``: every reason it cannot run this
  configuration (empty: it can). The dispatcher checks the platform (CUDA tensors, the GPU's
  architecture) itself and validation the tensors' layouts, so this is about the configuration
  only, and must answer without a GPU.
- ``cache_key(problem, options) -> Hashable``: which prepared runner can serve this problem. The
  dispatcher reuses one runner for every problem with the same key (kept per backend name), so
  the key holds what is compiled in (dtypes, head dim, mask kind, ...) and leaves out what the
  runner reads per call (sizes, scales, window lengths): new sizes then do not recompile.
- ``prepare(problem, options) -> runner``: compiles. ``runner(problem, q, k, v, out, lse,
  cu_seqlens_q, cu_seqlens_k, sinks=None)`` runs the call described by ``problem`` (whose key
  equals the prepared one), writes ``out`` (and ``lse`` unless it is None) in place and returns
  nothing; ``sinks`` is the (H_q,) tensor when ``problem.has_sinks``.
- optionally, for the backward: ``why_unsupported_backward(problem, options)``,
  ``backward_cache_key(problem, options)`` (as ``cache_key``, for the backward's runners) and
  ``prepare_backward(problem, options) -> runner``, ``runner(problem, dout, q, k, v, out, lse,
  dlse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, deterministic, sinks=None, dsinks=None)`` writing
  ``dq``, ``dk``, ``dv`` (and ``dsinks`` when ``problem.has_sinks``).
  A backend without them has no backward; the reference then computes it.
- optionally, for NSA's selection branch (``fmha.nsa``): ``why_unsupported_selection(problem,
  options)``, ``selection_cache_key`` and ``prepare_selection`` for a
  ``fmha.nsa.selection_visits.SelectionProblem``: ``runner(problem, q, k, v, selected,
  cu_seqlens, softmax_scale) -> (o, lse)`` on packed tokens; its backward likewise
  (``why_unsupported_selection_backward``, ``selection_backward_cache_key``,
  ``prepare_selection_backward``): ``runner(problem, dout, q, k, v, out, lse, dlse, selected,
  cu_seqlens, softmax_scale) -> (dq, dk, dv)``; and its top-k (``why_unsupported_topk``,
  ``topk_cache_key``, ``prepare_topk`` for a ``fmha.nsa.topk.TopKProblem``): ``runner(problem,
  q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, softmax_scale) -> selected``.
- optionally, for ``attention_with_kvcache``: ``why_unsupported_decode(problem, options)``,
  ``decode_cache_key(problem, options)`` and ``prepare_decode(problem, options) -> runner`` for a
  ``fmha.kvcache.DecodeProblem``: ``runner(problem, q, k_cache, v_cache, lengths, block_table, out,
  lse, sinks, cu_seqlens_q)`` (``cu_seqlens_q``: packed query rows where ``problem.packed_q``,
  else None), and ``runner.append(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table,
  capacity)``, which writes a call's new keys into the cache first.

One selection serves them all (``Kind``: ``FORWARD``, ``BACKWARD``, ``DECODE``, ``SELECTION``,
``SELECTION_BACKWARD``, ``TOPK``): ``select``
picks the backend, ``runner_for`` its prepared runner.

Kernel backends are imported lazily (the CuTe DSL costs about a second to import) and only
when the tensors are on a GPU, or when the caller asks for the reasons. An architecture joins
by adding its package under ``fmha/kernels/`` and a line to ``KERNEL_BACKENDS``; until the GPU
check has run on it (``self_check.VERIFIED_CAPABILITIES``), each of its prepared kernels proves
itself on a small problem against the reference before its first call (``fmha.self_check``).
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from .problem import AttentionProblem, KernelOptions, accumulate_dtype
from .reference import attention_backward_reference, attention_reference, cast_output

__all__ = [
    "BACKENDS",
    "UnsupportedError",
    "ReferenceBackend",
    "kernel_backends",
    "unsupported_reasons",
    "check_backend_name",
    "Kind",
    "FORWARD",
    "BACKWARD",
    "DECODE",
    "SELECTION",
    "SELECTION_BACKWARD",
    "TOPK",
    "select",
    "runner_for",
    "clear_cache",
]

logger = logging.getLogger("fmha")

#: the values of the public ``backend=`` argument
BACKENDS = ("auto", "kernel", "reference")

Runner = Callable[..., None]


class UnsupportedError(NotImplementedError):
    """No kernel backend can run this (valid) call. A ``NotImplementedError``, hence a
    ``RuntimeError``: the arguments are fine, the library lacks a kernel for them. ``reasons``
    lists every reason, one string each."""

    def __init__(self, reasons: Sequence[str]):
        self.reasons = list(reasons)
        super().__init__(
            "no fmha kernel supports this call:\n" + "\n".join(f"  - {r}" for r in self.reasons)
            + "\n(backend='auto' or 'reference' runs the PyTorch reference instead)"
        )


class ReferenceBackend:
    """The PyTorch reference behind the kernel interface: supports everything, computes in fp32
    and casts into ``out``."""

    name = "reference"

    def why_unsupported(self, problem, options) -> List[str]:
        return []

    def cache_key(self, problem: AttentionProblem, options: KernelOptions) -> Hashable:
        return ()

    backward_cache_key = cache_key

    def prepare(self, problem: AttentionProblem, options: KernelOptions) -> Runner:
        return self.run

    @staticmethod
    def run(problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, sinks=None, mods=None) -> None:
        with torch.no_grad():
            o, l = attention_reference(
                q, k, v, cu_seqlens_q, cu_seqlens_k,
                mask=problem.mask, softmax_scale=problem.softmax_scale,
                scale_q=problem.scale_q, scale_k=problem.scale_k,
                scale_v=problem.scale_v, inv_scale_o=problem.inv_scale_o,
                softcap=problem.softcap, sinks=sinks, compute_dtype=accumulate_dtype(problem.dtype), mods=mods,
            )
            out.copy_(cast_output(o, out.dtype))
            if lse is not None:
                lse.copy_(l)

    def prepare_backward(self, problem: AttentionProblem, options: KernelOptions) -> Runner:
        return self.run_backward

    @staticmethod
    def run_backward(problem: AttentionProblem, dout, q, k, v, out, lse, dlse, dq, dk, dv,
                     cu_seqlens_q, cu_seqlens_k, deterministic: bool, sinks=None, dsinks=None, mods=None) -> None:
        with torch.no_grad():
            grads = attention_backward_reference(
                dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                mask=problem.mask, softmax_scale=problem.softmax_scale,
                scale_q=problem.scale_q, scale_k=problem.scale_k,
                scale_v=problem.scale_v, inv_scale_o=problem.inv_scale_o, dlse=dlse,
                softcap=problem.softcap, sinks=sinks, compute_dtype=accumulate_dtype(problem.dtype), mods=mods,
            )
            for dst, g in zip((dq, dk, dv, dsinks), grads):
                if dst is not None:
                    dst.copy_(g)



REFERENCE = ReferenceBackend()


#: the kernel backends, tried in this order: (what the user reads, module, class)
KERNEL_BACKENDS = (
    ("the Hopper kernel", "fmha.kernels.hopper.backend", "HopperBackend"),
    ("the Blackwell kernel", "fmha.kernels.blackwell.backend", "BlackwellBackend"),
)


@functools.lru_cache(maxsize=None)
def _load_kernel_backends() -> Tuple[tuple, tuple]:
    """(backends, reasons some could not be loaded); imported once per process."""
    import importlib

    backends, reasons = [], []
    for what, module, cls in KERNEL_BACKENDS:
        try:
            backends.append(getattr(importlib.import_module(module), cls)())
        except ImportError as e:  # ModuleNotFoundError included
            reasons.append(f"{what} could not be imported: {e}")
    return tuple(backends), tuple(reasons)


def kernel_backends() -> Tuple[tuple, tuple]:
    return _load_kernel_backends()


def _platform_reasons(device: torch.device) -> List[str]:
    """Reasons no kernel can run, whatever the backend: the kernels are CUDA code."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"inputs are on the {'CPU' if device.type == 'cpu' else device}"
                       " (the kernels need CUDA tensors)")
    if not torch.cuda.is_available():
        reasons.append("no CUDA device is available (torch.cuda.is_available() is False)")
    return reasons


def _architecture_reason(backend, device: torch.device) -> Optional[str]:
    """Why ``backend`` cannot run on the GPU of ``device`` (None: it can, or no GPU to ask)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) in backend.capabilities:
        return None
    wanted = "/".join(f"SM{a}{b}" for a, b in backend.capabilities)
    return (f"the GPU {torch.cuda.get_device_name(device)} is SM{capability[0]}{capability[1]}; "
            f"this kernel runs on {wanted}")


class Kind(NamedTuple):
    """What a kernel backend is asked for: its support check, cache key and prepare methods by
    name, and whether its runners prove themselves on unverified GPUs (``fmha.self_check``)."""

    name: str
    why_unsupported: str
    cache_key: str
    prepare: str
    self_checked: bool


FORWARD = Kind("forward", "why_unsupported", "cache_key", "prepare", True)
BACKWARD = Kind("backward", "why_unsupported_backward", "backward_cache_key", "prepare_backward", True)
#: ``attention_with_kvcache`` (``fmha.kvcache.DecodeProblem``); the reference runs in kvcache.py
DECODE = Kind("decode", "why_unsupported_decode", "decode_cache_key", "prepare_decode", False)
#: NSA's selection branch (``fmha.nsa.selection_visits.SelectionProblem``); PyTorch runs it elsewhere
SELECTION = Kind("selection", "why_unsupported_selection", "selection_cache_key", "prepare_selection", False)
#: NSA's top-k block selection (``fmha.nsa.topk.TopKProblem``); PyTorch runs it elsewhere
TOPK = Kind("topk", "why_unsupported_topk", "topk_cache_key", "prepare_topk", False)
#: its backward
SELECTION_BACKWARD = Kind("selection_backward", "why_unsupported_selection_backward", "selection_backward_cache_key",
                          "prepare_selection_backward", False)


def unsupported_reasons(problem, options: KernelOptions, every_reason: bool = True,
                        kind: Kind = FORWARD) -> Tuple[Optional[object], List[str]]:
    """The first kernel backend that serves ``kind`` of the call, or None and the reasons none
    does.

    With ``every_reason`` False, a platform that no kernel can run on is reason enough: the
    kernel modules (and the DSL) are then not imported at all."""
    platform = _platform_reasons(problem.device)
    if platform and not every_reason:
        return None, platform
    backends, load_reasons = kernel_backends()
    reasons = platform + list(load_reasons)
    for backend in backends:
        if not hasattr(backend, kind.prepare):
            reasons.append(f"{backend.name}: no {kind.name} kernel yet")
            continue
        arch = _architecture_reason(backend, problem.device)
        why = ([arch] if arch else []) + getattr(backend, kind.why_unsupported)(problem, options)
        if not why and not platform:
            return backend, []
        reasons += [f"{backend.name}: {r}" for r in why]
    if not reasons:
        reasons = [f"no kernel serves this {kind.name} call on this machine"]
    return None, reasons


_logged_reasons: set = set()


def _log_fallback(reasons: Sequence[str]) -> None:
    for r in reasons:
        # Once per distinct reason: a training loop must not print this every step.
        if r not in _logged_reasons:
            _logged_reasons.add(r)
            logger.warning("fmha: using the PyTorch reference: %s", r)


def check_backend_name(backend) -> None:
    if backend not in BACKENDS:
        choices = ", ".join(map(repr, BACKENDS))
        raise ValueError(f"backend must be one of {choices}, got {backend!r}")


def select(kind: Kind, backend: str, problem, options: KernelOptions):
    """The backend object that runs ``kind`` of the call for ``backend=`` ('auto', 'kernel' or
    'reference'): the first kernel backend that serves it, else (unless 'kernel', which raises
    with every reason) the reference, with the reasons logged once."""
    check_backend_name(backend)
    if backend == "reference":
        return REFERENCE
    chosen, reasons = unsupported_reasons(problem, options, every_reason=backend == "kernel", kind=kind)
    if chosen is not None:
        return chosen
    if backend == "kernel":
        raise UnsupportedError(reasons)
    _log_fallback(reasons)
    return REFERENCE


_runners: Dict[Hashable, Runner] = {}


def runner_for(kind: Kind, backend_obj, problem, options: KernelOptions) -> Runner:
    """The prepared runner of ``kind`` for this problem, compiling only on the first use of its
    key (``backend_obj.<kind.cache_key>``)."""
    key = (kind.name, backend_obj.name, getattr(backend_obj, kind.cache_key)(problem, options))
    runner = _runners.get(key)
    if runner is None:
        runner = getattr(backend_obj, kind.prepare)(problem, options)
        if kind.self_checked:
            runner = _self_checked(runner, kind.name, backend_obj, key[2], problem)
        _runners[key] = runner
    return runner


def _self_checked(runner: Runner, kind: str, backend_obj, cfg, problem: AttentionProblem) -> Runner:
    """A kernel's runner, self-checked on first use where its GPU is not a verified one
    (``fmha.self_check``)."""
    from . import self_check

    if backend_obj is REFERENCE or not self_check.wanted(problem.device):
        return runner
    fallback = REFERENCE.run if kind == "forward" else REFERENCE.run_backward
    return self_check.SelfCheckedRunner(runner, kind, backend_obj.name, cfg, fallback)


# Calls repeat: a training or decoding loop calls with the same shapes, strides,
# dtypes and arguments every step. What validation, backend selection and the runner lookup decide depends
# on nothing else (data pointers aside, which the caller checks per call), so the API keys a
# call that passed on exactly that and reuses the outcome; validation is most of the host cost
# of a small call. Varlen calls key their offsets too (``fmha.dispatch._recall``).
_dispatch_memo: Dict[Hashable, tuple] = {}
_DISPATCH_MEMO_LIMIT = 1024


def recall_dispatch(key: Hashable, guard: tuple = ()) -> Optional[tuple]:
    """(problem, runner) remembered for a call key with the same ``guard`` objects (compared by
    identity: the records of what validation read), or None."""
    entry = _dispatch_memo.get(key)
    if entry is None or len(entry[2]) != len(guard) or any(a is not b for a, b in zip(entry[2], guard)):
        return None
    return entry[:2]


def remember_dispatch(key: Hashable, problem: AttentionProblem, runner: Runner, guard: tuple = ()) -> None:
    if len(_dispatch_memo) >= _DISPATCH_MEMO_LIMIT:
        _dispatch_memo.clear()
    _dispatch_memo[key] = (problem, runner, tuple(guard))


def clear_cache() -> None:
    """Forget every prepared runner (the next call of each configuration compiles again)."""
    _runners.clear()
    _dispatch_memo.clear()
