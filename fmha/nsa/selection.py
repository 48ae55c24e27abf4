"""Selection attention (docs/nsa.md, "Selection"): query t, every head of KV group h, attends
to the keys ``s <= t`` of the selection blocks listed in ``selected[t, h]`` (blocks of
``select_block`` tokens of t's own sequence; -1 entries are unused slots), one softmax over the
union. Returns o and the LSE like fmha's attention.

Runs as the custom ops ``fmha_nsa::selection_forward`` / ``selection_backward`` (opaque to
torch.compile, with autograd), for ``backend="kernel"`` and for "auto" on CUDA tensors the kernels
serve: on the selection kernels where they serve the call (the forward: each query tile of a few
tokens' GQA heads walks those tokens' blocks; the backward: each K/V tile of a sequence the query
tiles that chose it; ``selection_visits.py``), else on fmha's attention kernels with the lists
as a block mask and a mask mod (``selection_blocks.py``); else in PyTorch: each chunk of queries
gathers its listed blocks' keys and values (``_gather``), so memory stays bounded by
``CHUNK_BYTES`` and the backward recomputes P from the LSE as a kernel would.

An index past its sequence's blocks (or below -1) never reads anything: its keys lie after the
query, so the causal rule drops them; ``nsa_attention(selected=...)`` still rejects them.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..backends import UnsupportedError, check_backend_name
from ..problem import accumulate_dtype
from .checks import check_int, check_qkv, check_scale, check_selected, read_seqlens
from .layout import TokenPositions, token_positions

__all__ = ["selection_attention"]

#: budget of one chunk of gathered keys, values and scores
CHUNK_BYTES = 256 << 20


def _chunk(q, k, v, selected, select_block) -> int:
    heads_k, keys = k.shape[1], selected.shape[-1] * select_block
    per_query = heads_k * keys * (k.shape[-1] + v.shape[-1] + 3 * (q.shape[1] // heads_k)) * 8
    return max(1, CHUNK_BYTES // max(1, per_query))


def _gather(k, v, selected, where, a, z, select_block, cdt):
    """Keys/values (C, H_k, n*select_block, D) of queries a..z-1's listed blocks, their packed
    rows, and which of them the causal rule keeps (C, H_k, n*select_block)."""
    sel = selected[a:z].long()
    offsets = torch.arange(select_block, device=k.device)
    key_pos = (sel[..., None] * select_block + offsets).flatten(-2)  # position in the sequence
    keep = (sel[..., None] >= 0).expand(-1, -1, -1, select_block).flatten(-2)
    keep = keep & (key_pos <= where.position[a:z, None, None])
    rows = torch.where(keep, where.start[a:z, None, None] + key_pos, torch.zeros_like(key_pos))
    heads = torch.arange(k.shape[1], device=k.device)[None, :, None]
    return k[rows, heads].to(cdt), v[rows, heads].to(cdt), rows, heads, keep


def _selection_forward_torch(q, k, v, selected, cu, select_block, scale):
    return attend_selected(q, k, v, selected, token_positions(cu, q.shape[0]), select_block, scale)


def attend_selected(q, k, v, selected, where: TokenPositions, select_block: int, scale: float):
    """(o (N, H_q, D_v), lse (H_q, N)) of N queries q (N, H_q, D) over the rows of k (R, H_k, D)
    that their lists name: query n sits at ``where.position[n]`` of a sequence whose first row
    in k is ``where.start[n]`` (the packed tokens themselves, or a decode step's rows)."""
    cdt = accumulate_dtype(q.dtype)
    total, heads_q = q.shape[0], q.shape[1]
    heads_k = k.shape[1]
    group = heads_q // heads_k
    o = torch.zeros((total, heads_q, v.shape[-1]), dtype=cdt, device=q.device)
    lse = torch.full((heads_q, total), -math.inf, dtype=cdt, device=q.device)
    step = _chunk(q, k, v, selected, select_block)
    for a in range(0, total, step):
        z = min(a + step, total)
        kg, vg, _, _, keep = _gather(k, v, selected, where, a, z, select_block, cdt)
        qg = q[a:z].to(cdt).view(z - a, heads_k, group, -1)
        s = torch.einsum("chgd,chmd->chgm", qg, kg) * scale
        s = s.masked_fill(~keep[:, :, None, :], -math.inf)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # no key kept: exp gives 0, not NaN
        p = (s - m).exp()
        row_sum = p.sum(-1, keepdim=True)
        some = row_sum > 0
        oc = torch.einsum("chgm,chmv->chgv", p, vg) / torch.where(some, row_sum, torch.ones_like(row_sum))
        o[a:z] = oc.reshape(z - a, heads_q, -1)
        lc = torch.where(some, m + row_sum.log(), torch.full_like(m, -math.inf))
        lse[:, a:z] = lc.reshape(z - a, heads_q).T
    return o.to(q.dtype), lse


def _selection_backward_torch(dout, q, k, v, out, lse, dlse, selected, cu, select_block, scale, deterministic=False):
    cdt = accumulate_dtype(q.dtype)
    total, heads_q = q.shape[0], q.shape[1]
    heads_k = k.shape[1]
    group = heads_q // heads_k
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1)  # (T, H_q)
    if dlse is not None:
        delta = delta - dlse.to(cdt).T
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(cdt).T  # (T, H_q); P = 0 there
    where = token_positions(cu, total)
    step = _chunk(q, k, v, selected, select_block)
    for a in range(0, total, step):
        z = min(a + step, total)
        kg, vg, rows, heads, keep = _gather(k, v, selected, where, a, z, select_block, cdt)
        qg = q[a:z].to(cdt).view(z - a, heads_k, group, -1)
        do = dout[a:z].to(cdt).view(z - a, heads_k, group, -1)
        s = (torch.einsum("chgd,chmd->chgm", qg, kg) * scale).masked_fill(~keep[:, :, None, :], -math.inf)
        p = (s - lse[a:z].reshape(z - a, heads_k, group, 1)).exp()
        dp = torch.einsum("chgv,chmv->chgm", do, vg)
        ds = p * (dp - delta[a:z].reshape(z - a, heads_k, group, 1))
        dq[a:z] = (torch.einsum("chgm,chmd->chgd", ds, kg) * scale).reshape(z - a, heads_q, -1)
        # blocks are shared by queries: accumulate (rows dropped by the mask add zeros to row 0)
        index = (rows, heads.expand_as(rows))
        with _deterministic_algorithms(deterministic and q.is_cuda):  # CUDA's accumulate sorts, no atomics
            dk.index_put_(index, torch.einsum("chgm,chgd->chmd", ds, qg) * scale, accumulate=True)
            dv.index_put_(index, torch.einsum("chgm,chgv->chmv", p, do), accumulate=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@contextlib.contextmanager
def _deterministic_algorithms(wanted: bool):
    """PyTorch's deterministic algorithms on for the block, where wanted and not already on."""
    if not wanted or torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)


def _packed_rows_fit(q: Tensor, k: Tensor) -> bool:
    """Whether the selection kernels' packed rows (each token's GQA group, T * g of them) have
    int32 row indices."""
    return q.shape[0] * (q.shape[1] // k.shape[1]) < 2 ** 31


def _selection_forward_kernels(q, k, v, selected, cu, select_block, scale):
    """The selection kernel where one serves the call (each query tile walks its tokens' own
    blocks), else fmha's attention kernels with the lists as a block mask."""
    from ..backends import SELECTION, runner_for, unsupported_reasons
    from ..problem import KernelOptions
    from .selection_visits import SelectionProblem

    problem = SelectionProblem.of(q, k, v, select_block)
    chosen, _ = unsupported_reasons(problem, KernelOptions(), kind=SELECTION)
    if chosen is not None and _packed_rows_fit(q, k):
        return runner_for(SELECTION, chosen, problem, KernelOptions())(problem, q, k, v, selected, cu, scale)
    return selection_forward_block_mask(q, k, v, selected, cu, select_block, scale)


def selection_forward_block_mask(q, k, v, selected, cu, select_block, scale):
    """The forward on fmha's attention kernels, the lists as a block mask (``selection_blocks``)."""
    from .. import attention
    from .selection_blocks import selection_mask

    bm, aux = selection_mask(selected, cu, select_block, q.shape[1])
    o, lse = attention(q[None], k[None], v[None], causal=True, softmax_scale=scale, block_mask=bm, aux=aux,
                       return_lse=True, backend="kernel")
    return o[0], lse[0]


def _selection_backward_kernels(dout, q, k, v, out, lse, dlse, selected, cu, select_block, scale, deterministic):
    """The selection backward kernel where one serves the call (each K/V tile walks the query
    tiles that chose it), else fmha's backward kernel with the lists as a block mask."""
    from ..backends import SELECTION_BACKWARD, runner_for, unsupported_reasons
    from ..problem import KernelOptions
    from .selection_visits import SelectionProblem

    problem = SelectionProblem.of(q, k, v, select_block)
    options = KernelOptions(deterministic=deterministic)
    chosen, _ = unsupported_reasons(problem, options, kind=SELECTION_BACKWARD)
    if chosen is not None and _packed_rows_fit(q, k):
        runner = runner_for(SELECTION_BACKWARD, chosen, problem, options)
        return runner(problem, dout, q, k, v, out, lse, dlse, selected, cu, scale)
    return selection_backward_block_mask(dout, q, k, v, out, lse, dlse, selected, cu, select_block, scale,
                                         deterministic)


def selection_backward_block_mask(dout, q, k, v, out, lse, dlse, selected, cu, select_block, scale,
                                  deterministic=False):
    """The backward on fmha's backward kernel, the lists as a block mask (``selection_blocks``)."""
    from .. import attention_backward
    from .selection_blocks import selection_mask

    bm, aux = selection_mask(selected, cu, select_block, q.shape[1])
    dq, dk, dv = attention_backward(dout[None], q[None], k[None], v[None], out[None], lse[None],
                                    dlse=None if dlse is None else dlse[None], causal=True, softmax_scale=scale,
                                    block_mask=bm, aux=aux, backend="kernel", deterministic=deterministic)
    return dq[0], dk[0], dv[0]


def _try_kernels(backend: str, q: Tensor) -> bool:
    """Whether to try the kernel form first; "auto" falls back to PyTorch where it is refused."""
    return backend == "kernel" or (backend == "auto" and q.is_cuda)


@torch.library.custom_op("fmha_nsa::selection_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, selected: Tensor, cu_seqlens: Tensor, select_block: int,
                softmax_scale: float, backend: str, deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    if _try_kernels(backend, q):
        try:
            return _selection_forward_kernels(q, k, v, selected, cu_seqlens, select_block, softmax_scale)
        except UnsupportedError:  # raised before any launch, with the reasons
            if backend == "kernel":
                raise
    return _selection_forward_torch(q, k, v, selected, cu_seqlens, select_block, softmax_scale)


@_forward_op.register_fake
def _forward_fake(q, k, v, selected, cu_seqlens, select_block, softmax_scale, backend, deterministic=False):
    o = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=accumulate_dtype(q.dtype))


@torch.library.custom_op("fmha_nsa::selection_backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
                 selected: Tensor, cu_seqlens: Tensor, select_block: int, softmax_scale: float,
                 backend: str, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    if _try_kernels(backend, q):
        try:
            return _selection_backward_kernels(dout, q, k, v, out, lse, dlse, selected, cu_seqlens, select_block,
                                               softmax_scale, deterministic)
        except UnsupportedError:
            if backend == "kernel":
                raise
    return _selection_backward_torch(dout, q, k, v, out, lse, dlse, selected, cu_seqlens, select_block,
                                     softmax_scale, deterministic)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, selected, cu_seqlens, select_block, softmax_scale, backend,
                   deterministic=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    q, k, v, selected, cu, select_block, scale, backend, deterministic = inputs
    ctx.args = (select_block, scale, backend, deterministic)
    ctx.save_for_backward(q, k, v, selected, cu, *output)


def _backward(ctx, dout, dlse):
    q, k, v, selected, cu, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fmha_nsa.selection_backward(dout.contiguous(), q, k, v, out, lse, dlse, selected, cu,
                                                       *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def selection_attention(q: Tensor, k: Tensor, v: Tensor, selected: Tensor, cu_seqlens: Tensor,
                        select_block: int = 64, *, softmax_scale: Optional[float] = None,
                        backend: str = "auto", check_selected_values: bool = True,
                        deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """Selection attention on packed q (T, H_q, D), k (T, H_k, D), v (T, H_k, D_v) with
    ``cu_seqlens``; ``selected`` (T, H_k, n) int32 (``select_blocks``' output, or your own).
    Returns o (T, H_q, D_v) in q's dtype and lse (H_q, T) fp32 (fp64 for fp64); a query whose
    list keeps no key gets 0 and -inf. Differentiable in q, k, v. ``backend``: "kernel" runs
    fmha's selection kernels, or where they do not serve the call its attention kernels with the
    lists as a block mask (``selection_blocks``), raising where neither can; "auto" does so for
    CUDA tensors and else, or where the kernels refuse, runs the PyTorch path; "reference" always
    runs the PyTorch path.
    ``check_selected_values=False`` skips reading ``selected`` on the host (range, no
    duplicates): a duplicate would then count its keys twice. ``deterministic``: a
    bitwise-repeatable backward (the selection backward kernel adds in a fixed order; the
    block-mask form has no such mode, so "kernel" then raises where the selection kernel does not
    serve the call, and "auto" runs PyTorch's deterministic algorithms)."""
    if deterministic is not False and deterministic is not True:
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    check_int("select_block", select_block)
    check_backend_name(backend)
    check_qkv(q, k, v, packed=True)
    scale = check_scale(softmax_scale, q.shape[-1])
    if not torch.compiler.is_compiling():
        read_seqlens("cu_seqlens", cu_seqlens, q.shape[0], q.device)
    selected = check_selected(selected, k, cu_seqlens, select_block, read_values=check_selected_values)
    return torch.ops.fmha_nsa.selection_forward(q, k, v, selected, cu_seqlens, select_block, scale, backend,
                                                deterministic)
