"""First-use self-check of compiled kernels on GPUs they were not verified on.

The kernels are verified by the GPU check (``python -m pytest -m gpu``) on the architectures in
``VERIFIED_CAPABILITIES``. On any other GPU (a Blackwell kernel compiled and machine-code-checked
without one, say), the first call of each prepared kernel first runs a small problem of the same
configuration (same dtypes, head dim, mask and window, GQA, varlen, LSE and scales; odd sizes,
an empty and a length-1 sequence) through it and compares the result with the PyTorch
reference. A mismatch logs one warning, marks the configuration unusable on this GPU (in the
disk cache too, so later processes skip it) and that call and every later one run the reference.
A configuration that passes is marked too, and is not checked again.

``FMHA_SELF_CHECK=1`` checks on every GPU (the verified ones included), ``FMHA_SELF_CHECK=0``
never.
"""

from __future__ import annotations

import logging
import math
import os
import re
from typing import Callable, Optional

import torch

from .problem import AttentionProblem

_log = logging.getLogger("fmha")

#: compute capabilities whose kernels the GPU check has run on
VERIFIED_CAPABILITIES = frozenset({(9, 0)})

#: relative L2 error against the fp32 reference beyond which a kernel is wrong (well above the
#: GPU check's own tolerances, which its cases meet with room to spare)
_FORWARD_TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 1e-1}
_BACKWARD_TOL = {torch.float16: 2e-2, torch.bfloat16: 4e-2}
_LSE_TOL = 1e-2


def wanted(device: torch.device) -> bool:
    """Whether kernels prepared for ``device`` are self-checked on first use."""
    forced = os.environ.get("FMHA_SELF_CHECK")
    if forced in ("0", "1"):
        return forced == "1"
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return tuple(torch.cuda.get_device_capability(device)) not in VERIFIED_CAPABILITIES


def _device_label(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{re.sub(r'[^A-Za-z0-9]+', '-', name)}-sm{major}{minor}"


class SelfCheckedRunner:
    """A kernel runner that proves itself on a small problem before its first real call.

    ``kind``: "forward" or "backward" (the runner's calling convention, ``fmha.backends``);
    ``cfg``: the configuration (names the disk-cache mark); ``fallback``: the reference runner."""

    def __init__(self, runner: Callable, kind: str, backend_name: str, cfg, fallback: Callable):
        self.runner, self.kind, self.backend_name, self.cfg, self.fallback = runner, kind, backend_name, cfg, fallback
        self.usable: Optional[bool] = None

    def __call__(self, problem: AttentionProblem, *args) -> None:
        if self.usable is None:
            self.usable = self._check(problem)
        (self.runner if self.usable else self.fallback)(problem, *args)

    # ---- the check
    def _mark_path(self, device: torch.device):
        from .jit import disk_cache

        if not disk_cache.enabled():
            return None
        try:
            name = disk_cache.entry_name(self.cfg)
        except Exception:  # no DSL to name the entry: keep the verdict in memory only
            return None
        return disk_cache.cache_dir() / f"{name}.{self.kind}.{_device_label(device)}.selfcheck"

    def _check(self, problem: AttentionProblem) -> bool:
        path = self._mark_path(problem.device)
        if path is not None and path.exists():
            verdict = path.read_text()
            if verdict.startswith("ok"):
                return True
            self._warn(problem.device, verdict, path)
            return False
        error = self._run_small(problem)
        verdict = "ok" if error is None else f"mismatch: {error}"
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(verdict)
            except OSError as e:
                _log.warning("fmha: could not record the self-check in %s (%s)", path, e)
        if error is not None:
            self._warn(problem.device, verdict, path)
        return error is None

    def _warn(self, device, verdict, path) -> None:
        where = f"; marked in {path}" if path is not None else ""
        _log.warning("fmha: the %s %s kernel (%r) failed its self-check on %s (%s), which is not among the "
                     "GPUs it was verified on; this configuration runs the PyTorch reference%s",
                     self.backend_name, self.kind, self.cfg, _device_label(device), verdict, where)

    def _run_small(self, problem: AttentionProblem) -> Optional[str]:
        """None if the kernel matches the reference on a small problem like ``problem``, else
        what differed. A kernel that raises fails too."""
        try:
            inputs = small_inputs(problem)
            if self.kind == "forward":
                return _check_forward(self.runner, problem, *inputs)
            return _check_backward(self.runner, problem, *inputs)
        except Exception as e:  # a launch failure is a failed check, not a crash of the user's call
            return f"{type(e).__name__}: {e}"


def small_inputs(problem: AttentionProblem):
    """(small problem, q, k, v, cu_q, cu_k, sinks): random inputs of ``problem``'s configuration at
    sizes that are not multiples of any tile, validated as the API validates them."""
    from .validation import validate

    dev = problem.device
    gen = torch.Generator(device=dev).manual_seed(1234)
    group = max(problem.num_heads_q // max(problem.num_heads_k, 1), 1)
    hk = 2
    hq = hk * min(group, 4)
    m = problem.mask
    compressed = m.kind.name == "COMPRESSED_CAUSAL"

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev).to(problem.dtype)

    if problem.varlen:
        lens_q = [77, 0, 130, 1]
        lens_k = [38, 0, 65, 1] if compressed else [90, 5, 130, 1]
        cu = [torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))], dtype=torch.int32, device=dev)
              for ls in (lens_q, lens_k)]
        q, k, v = rand(sum(lens_q), hq, problem.head_dim), rand(sum(lens_k), hk, problem.head_dim), \
            rand(sum(lens_k), hk, problem.head_dim_v)
        cu_q, cu_k = cu
        extra = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k)) if problem.seqlens_q is None else {}
    else:
        sq, sk = (200, 100) if compressed else (200, 300)
        q, k, v = rand(2, sq, hq, problem.head_dim), rand(2, sk, hk, problem.head_dim), \
            rand(2, sk, hk, problem.head_dim_v)
        cu_q = cu_k = None
        extra = {}
    sinks = torch.randn(hq, generator=gen, device=dev) if problem.has_sinks else None
    small = validate(q, k, v, varlen=problem.varlen, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=False,
                     window_size=(m.window_left, m.window_right) if m.kind.name == "WINDOW" else (None, None),
                     mask_align="bottom_right" if m.bottom_right else "top_left", compressed_causal=compressed,
                     softmax_scale=problem.softmax_scale, scale_q=problem.scale_q, scale_k=problem.scale_k,
                     scale_v=problem.scale_v, inv_scale_o=problem.inv_scale_o, return_lse=problem.return_lse,
                     out_dtype=problem.out_dtype, softcap=problem.softcap, sinks=sinks, **extra)
    return small, q, k, v, cu_q, cu_k, sinks


def _rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.float().nan_to_num(nan=1e30)
    norm = want.norm().item()
    diff = (got - want).norm().item()
    return diff / norm if norm > 0 else diff


def _check_forward(runner, problem, small, q, k, v, cu_q, cu_k, sinks) -> Optional[str]:
    from .reference import attention_reference
    from .validation import lse_shape, out_shape

    out = torch.full(out_shape(q, v.shape[-1]), math.nan, device=q.device).to(small.out_dtype)
    lse = torch.full(lse_shape(q, small.varlen), math.nan, device=q.device) if small.return_lse else None
    runner(small, q, k, v, out, lse, cu_q, cu_k, sinks)
    want_o, want_lse = attention_reference(q, k, v, cu_q, cu_k, mask=small.mask, softmax_scale=small.softmax_scale,
                                           scale_q=small.scale_q, scale_k=small.scale_k, scale_v=small.scale_v,
                                           inv_scale_o=small.inv_scale_o, softcap=small.softcap, sinks=sinks)
    err = _rel_l2(out, want_o)
    if not err < _FORWARD_TOL.get(small.dtype, 2e-2):
        return f"O relative L2 error {err:.3g}"
    if lse is not None:
        finite = torch.isfinite(want_lse)
        if not torch.equal(torch.isneginf(lse), torch.isneginf(want_lse)):
            return "LSE -inf rows differ"
        worst = (lse[finite] - want_lse[finite]).abs().max().item() if finite.any() else 0.0
        if not worst < _LSE_TOL * (5 if small.dtype == torch.float8_e4m3fn else 1):
            return f"LSE max abs error {worst:.3g}"
    return None


def _check_backward(runner, problem, small, q, k, v, cu_q, cu_k, sinks) -> Optional[str]:
    from .reference import attention_backward_reference, attention_reference, cast_output

    scales = dict(softmax_scale=small.softmax_scale, scale_q=small.scale_q, scale_k=small.scale_k,
                  scale_v=small.scale_v, inv_scale_o=small.inv_scale_o, softcap=small.softcap, sinks=sinks)
    out, lse = attention_reference(q, k, v, cu_q, cu_k, mask=small.mask, **scales)
    out = cast_output(out, q.dtype)
    gen = torch.Generator(device=q.device).manual_seed(4321)
    dout = torch.randn(out.shape, generator=gen, device=q.device).to(q.dtype)
    want = attention_backward_reference(dout, q, k, v, out, lse, cu_q, cu_k, mask=small.mask, **scales)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    dsinks = None if sinks is None else torch.full_like(sinks, math.nan)
    runner(small, dout, q, k, v, out, lse, None, *grads, cu_q, cu_k, False, sinks, dsinks)
    if dsinks is not None:
        grads.append(dsinks)
    for name, got, ref in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        err = _rel_l2(got, ref)
        if not err < _BACKWARD_TOL.get(small.dtype, 4e-2):
            return f"{name} relative L2 error {err:.3g}"
    return None
