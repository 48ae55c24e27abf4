"""Top-k block selection (docs/nsa.md, "Selection"): for each query token and KV group, the
selection blocks its selection attention reads.

The scores are the compression branch's attention probabilities ``p = exp(q.k_cmp * scale -
lse_cmp)``, summed over the group's query heads and, for each selection block, over the
compressed blocks that overlap it. The current block, the one before it and block 0 are always
taken (in that priority), then the highest scores, the lower block index winning a tie, among the
blocks that start at or before the query. The list is returned in ascending block order, padded
with -1 at the end.

Runs as the custom op ``fmha_nsa::select_blocks`` (no autograd: indices): with "auto" and
"kernel" the fused kernel on a Hopper GPU (``kernels/common/block_topk.py``: the scores never
leave the chip), with "reference" and where that kernel does not serve the call ("kernel"
raises) PyTorch (``_select_blocks_torch``, a bounded chunk of queries at a time, each against
one window of compressed keys). It reads nothing on the host: its shapes
follow from the token counts and ``max_seqlen`` (the longest sequence; 0 = unknown, taken as T),
so a CUDA graph captures it. A sequence longer than ``max_seqlen`` sets the device error flag
(``fmha.check_device_errors``; on the CPU it raises).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..backends import UnsupportedError, check_backend_name
from ..problem import accumulate_dtype
from .checks import (check_compressed_offsets, check_geometry, check_int, check_like_q, check_offsets_tensor,
                     check_qkv, check_scale)
from .layout import num_compressed_blocks, num_selection_blocks, token_positions, visible_compressed_blocks

__all__ = ["select_blocks", "overlap_matrix", "block_probabilities", "block_scores", "rank_blocks"]

#: budget of one chunk of scores (C x H_q x T_c)
CHUNK_BYTES = 128 << 20


def overlap_matrix(n_cmp: int, n_slc: int, block: int, stride: int, select_block: int, dtype, device) -> Tensor:
    """(n_cmp, n_slc) 0/1: compressed block i ([i*stride, i*stride + block)) overlaps selection
    block j ([j*select_block, (j+1)*select_block))."""
    i = torch.arange(n_cmp, device=device)[:, None]
    j = torch.arange(n_slc, device=device)[None, :]
    return ((i * stride < (j + 1) * select_block) & (i * stride + block > j * select_block)).to(dtype)


def rank_blocks(scores: Tensor, positions: Tensor, select_block: int, select_count: int, group: int) -> Tensor:
    """int32 (C, H_k, select_count) from scores (C, H_k, N_s) of queries at ``positions`` (C,)."""
    n_slc = scores.shape[-1]
    j = torch.arange(n_slc, device=scores.device)[None, :]
    current = (positions // select_block)[:, None]
    # forced blocks outrank every score: a block's score is at most the group's head count
    top = 2.0 * group + 2.0
    tier = torch.where(j == current, 3, torch.where(j == current - 1, 2, torch.where(j == 0, 1, 0)))
    key = torch.where((j <= current)[:, None, :], scores, torch.full_like(scores, -1.0))
    key = torch.where(tier[:, None, :] > 0, (tier * top).to(scores.dtype)[:, None, :], key)
    # a stable descending sort keeps the lower index first among equal keys
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :select_count]
    chosen = torch.where(key.gather(-1, order) >= 0, order, torch.full_like(order, n_slc))
    chosen = chosen.sort(dim=-1).values  # ascending; the n_slc sentinels of empty slots go last
    chosen = torch.where(chosen == n_slc, torch.full_like(chosen, -1), chosen).to(torch.int32)
    if chosen.shape[-1] < select_count:
        chosen = torch.cat([chosen, chosen.new_full(chosen.shape[:-1] + (select_count - chosen.shape[-1],), -1)], -1)
    return chosen


def block_probabilities(s: Tensor, lse: Tensor, visible: Tensor) -> Tensor:
    """The compression probabilities (..., H_k, C) of queries' scaled scores s (..., H_k, g, C)
    whose compression LSE is ``lse`` (..., H_k, g, 1), summed over the group: zero where
    ``visible`` (broadcast against s) is False or the query sees no compressed block."""
    keep = visible & torch.isfinite(lse)
    p = torch.where(keep, (s - torch.where(keep, lse, torch.zeros_like(lse))).exp(), torch.zeros_like(s))
    return p.sum(-2)


def block_scores(s: Tensor, lse: Tensor, visible: Tensor, overlap: Tensor) -> Tensor:
    """Selection-block scores (..., H_k, N_s): ``block_probabilities`` mapped onto selection
    blocks by ``overlap`` (C, N_s)."""
    return block_probabilities(s, lse, visible) @ overlap


def _offsets_on_device(cu: Tensor, cu_cmp: Tensor, rows: int, rows_cmp: int, block: int, stride: int,
                       max_seqlen: int):
    """(cu, cu_cmp) as the top-k may read them, made without a host read (CUDA graphs capture
    it): offsets in range and nondecreasing, 0 first and T last, the compressed ones those of
    the token ones and at most T_c. Offsets that were not so, or a sequence longer than
    ``max_seqlen`` (which would lose its later blocks), set the device error flag
    (``fmha.check_device_errors``); on the CPU they raise."""
    from .layout import compressed_cu_seqlens

    if cu.device.type != "cuda":
        lens = check_compressed_offsets(cu, cu_cmp, rows, rows_cmp, block, stride, cu.device)
        if max_seqlen > 0 and max(lens or [0]) > max_seqlen:
            raise ValueError(f"a sequence of cu_seqlens is longer than max_seqlen = {max_seqlen}; pass the "
                             "longest sequence's length, or 0 to bound it by the packed token count")
        return cu, cu_cmp
    from .. import device_errors
    from ..kernels.common.error_bits import BAD_OFFSETS

    safe = torch.cummax(cu.clamp(0, rows), 0).values
    at = torch.arange(cu.numel(), device=cu.device)  # 0 first and T last, without a host-to-device copy
    safe = torch.where(at == 0, 0, torch.where(at == cu.numel() - 1, rows, safe))
    safe_cmp = compressed_cu_seqlens(safe, block, stride).clamp_(max=rows_cmp)
    bad = (safe != cu).any() | (safe_cmp != cu_cmp).any()
    if max_seqlen > 0:
        bad |= ((safe[1:] - safe[:-1]) > max_seqlen).any()
    device_errors.flag(cu.device).bitwise_or_(bad.int() * BAD_OFFSETS)
    device_errors.watch(cu.device)
    return safe, safe_cmp


def _select_blocks_torch(q, k_cmp, lse_cmp, cu, cu_cmp, block, stride, select_block, select_count, scale,
                         max_seqlen):
    # The offsets stay on the device (no host read, so CUDA graphs capture it): every shape
    # follows from T, T_c and the longest sequence's length.
    cdt = accumulate_dtype(q.dtype)
    rows, rows_cmp, heads_k = q.shape[0], k_cmp.shape[0], k_cmp.shape[1]
    group = q.shape[1] // heads_k
    out = torch.full((rows, heads_k, select_count), -1, dtype=torch.int32, device=q.device)
    if rows == 0:
        return out
    longest = max_seqlen if max_seqlen > 0 else rows
    n_seen = max(1, num_compressed_blocks(longest, block, stride))  # the most one query sees
    n_slc = num_selection_blocks(longest, select_block)
    overlap = overlap_matrix(n_seen, n_slc, block, stride, select_block, cdt, q.device)
    where = token_positions(cu, rows)
    first_cmp = cu_cmp.long()[where.sequence]  # each row's sequence's first compressed key
    seen = visible_compressed_blocks(where.position, block, stride)
    own = torch.arange(n_seen, device=q.device)[None, :]
    step = max(1, CHUNK_BYTES // (q.shape[1] * (n_seen + n_slc + 2) * 4 * 3))
    step = min(step, stride * (n_seen + 1))  # the window below grows by step / stride
    for a in range(0, rows, step):
        z = min(a + step, rows)
        if rows_cmp == 0:
            scores = torch.zeros((z - a, heads_k, n_slc), dtype=cdt, device=q.device)
        else:
            # Rows a..z-1 see compressed keys of row a's sequence (at most longest / stride) and
            # of later sequences within the chunk (at most (z - a) / stride): one window of keys.
            width = min(rows_cmp, (longest + z - a) // stride + 1)
            base = first_cmp[a]
            kc = k_cmp.index_select(0, (base + torch.arange(width, device=q.device)).clamp(max=rows_cmp - 1))
            qc = q[a:z].to(cdt).view(z - a, heads_k, group, -1)
            s = torch.einsum("chgd,whd->chgw", qc, kc.to(cdt)) * scale
            lse = lse_cmp[:, a:z].to(cdt).T.reshape(z - a, heads_k, group, 1)
            offset = (first_cmp[a:z] - base)[:, None]  # where each row's sequence starts in the window
            w = torch.arange(width, device=q.device)[None, :]
            visible = (w >= offset) & (w < offset + seen[a:z, None])
            p = block_probabilities(s, lse, visible[:, None, None, :])  # (C, H_k, width)
            # into each row's own frame (compressed block i of its sequence), then onto selection blocks
            p = p.gather(-1, (offset + own).clamp(max=width - 1)[:, None, :].expand(-1, heads_k, -1))
            p = torch.where((own < seen[a:z, None])[:, None, :], p, torch.zeros_like(p))  # and the clamped ones
            scores = p @ overlap
        out[a:z] = rank_blocks(scores, where.position[a:z], select_block, select_count, group)
    return out


@dataclass(frozen=True)
class TopKProblem:
    """What a top-k kernel is asked (``fmha.backends.TOPK``): everything it is compiled for, the
    longest sequence (its scores per token) and the device."""

    dtype: torch.dtype
    head_dim: int
    heads_q: int
    heads_k: int
    block: int
    stride: int
    select_block: int
    select_count: int
    max_seqlen: int
    device: torch.device


def _topk_kernel(q, k_cmp, block, stride, select_block, select_count, max_seqlen, backend):
    """(runner, problem) of the top-k kernel where it serves the call ("kernel" raises
    ``UnsupportedError`` where it does not), else None: the PyTorch path ("reference", and
    "auto" where no kernel serves the call)."""
    from ..backends import TOPK, runner_for, unsupported_reasons
    from ..problem import KernelOptions

    if backend == "reference" or (backend == "auto" and q.device.type != "cuda"):
        return None
    problem = TopKProblem(q.dtype, q.shape[-1], q.shape[1], k_cmp.shape[1], block, stride, select_block,
                          select_count, max_seqlen if max_seqlen > 0 else q.shape[0], q.device)
    chosen, reasons = unsupported_reasons(problem, KernelOptions(), kind=TOPK)
    if chosen is None:
        if backend == "kernel":
            raise UnsupportedError(reasons)
        return None
    return runner_for(TOPK, chosen, problem, KernelOptions()), problem


@torch.library.custom_op("fmha_nsa::select_blocks", mutates_args=())
def _select_blocks_op(q: Tensor, k_cmp: Tensor, lse_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                      block: int, stride: int, select_block: int, select_count: int, softmax_scale: float,
                      backend: str, max_seqlen: int = 0, offsets_checked: bool = False) -> Tensor:
    check_offsets_tensor("cu_seqlens", cu_seqlens, q.device)
    check_offsets_tensor("cu_seqlens_cmp", cu_seqlens_cmp, q.device)
    if cu_seqlens_cmp.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cmp must be as long as cu_seqlens ({cu_seqlens.numel()}: one offset per "
                         f"sequence and the end), got {cu_seqlens_cmp.numel()}; fmha.nsa.compressed_cu_seqlens "
                         "builds it")
    if not offsets_checked:
        cu_seqlens, cu_seqlens_cmp = _offsets_on_device(cu_seqlens, cu_seqlens_cmp, q.shape[0], k_cmp.shape[0],
                                                        block, stride, max_seqlen)
    kernel = _topk_kernel(q, k_cmp, block, stride, select_block, select_count, max_seqlen, backend)
    if kernel is not None:
        runner, problem = kernel
        return runner(problem, q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, softmax_scale)
    return _select_blocks_torch(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, select_block,
                                select_count, softmax_scale, max_seqlen)


@_select_blocks_op.register_fake
def _select_blocks_fake(q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, select_block, select_count,
                        softmax_scale, backend, max_seqlen=0, offsets_checked=False):
    return q.new_empty((q.shape[0], k_cmp.shape[1], select_count), dtype=torch.int32)


def select_blocks(q: Tensor, k_cmp: Tensor, lse_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                  block: int = 32, stride: int = 16, select_block: int = 64, select_count: int = 16, *,
                  softmax_scale: Optional[float] = None, backend: str = "auto",
                  max_seqlen: Optional[int] = None) -> Tensor:
    """int32 (T, H_k, select_count): the selection blocks of each packed query (T, H_q, D) and KV
    group, from the compressed keys k_cmp (T_c, H_k, D) and the compression branch's LSE
    (H_q, T) (``compression_attention``'s). Module doc for the rule. ``backend``: "kernel"
    runs the fused top-k kernel (module doc) or raises ``UnsupportedError``; "auto" runs it
    where it serves the call and PyTorch elsewhere; "reference" PyTorch. ``max_seqlen``: the
    longest sequence's length or more (0: unknown, bounded by T); given, the offsets are
    checked on the device (a bad one sets the flag ``fmha.check_device_errors`` reads) instead
    of read on the host, so the call does not wait for the GPU; None reads them."""
    check_geometry(block, stride, select_block, select_count)
    check_backend_name(backend)
    check_qkv(q, k_cmp, k_cmp, packed=True, names=("q", "k_cmp", "k_cmp"), same_tokens=False)
    check_like_q("lse_cmp", lse_cmp, q, (q.shape[1], q.shape[0]), "(H_q, T), compression_attention's LSE")
    scale = check_scale(softmax_scale, q.shape[-1])
    lens = None
    if max_seqlen is None:
        lens = check_compressed_offsets(cu_seqlens, cu_seqlens_cmp, q.shape[0], k_cmp.shape[0], block, stride,
                                        q.device)
        max_seqlen = max(lens or [0])
    else:
        check_int("max_seqlen", max_seqlen, 0)
    return torch.ops.fmha_nsa.select_blocks(q.detach(), k_cmp.detach(), lse_cmp.detach(), cu_seqlens,
                                            cu_seqlens_cmp, block, stride, select_block, select_count, scale,
                                            backend, max_seqlen, lens is not None)
