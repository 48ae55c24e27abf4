"""The host side of NSA's selection branch on the Hopper kernels: each packed token's GQA group
becomes consecutive query rows of one K/V head (as decode packs them) and the selection lists
become the kernels' visits (``fmha.nsa.selection_visits``). The forward kernel
(``selection_config``) walks each query tile's blocks; the backward kernel
(``selection_backward_config``) each sequence's K/V tiles over the query tiles that chose them,
as a varlen batch of the packed rows. Results go back to the tokens' layout."""

from __future__ import annotations

import math
from typing import Callable

import torch

from fmha import split_kv
from fmha.jit import disk_cache
from fmha.jit.launch import sm_count
from fmha.masking import MaskSpec
from fmha.nsa.selection_visits import (SelectionProblem, selection_backward_order, selection_backward_visits,
                                       selection_visits, split_key_rows)
from fmha.problem import AttentionProblem, KernelOptions

from . import dq_layout
from .backward_runner import HopperBackwardRunner, compile_backward, tile_capacity
from .bwd_config import (HOPPER_SMS, backward_head_dim_served, selection_backward_config,
                         selection_backward_tile_positions)
from .config import SELECTION_TILE, head_dims_served, selection_config, selection_tile_positions
from .forward_runner import ForwardArgs, compile_forward


def why_unsupported_selection(problem: SelectionProblem) -> list:
    """Every reason the selection kernel cannot run ``problem``."""
    reasons = []
    if problem.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the Hopper selection kernel takes float16/bfloat16 inputs, not {problem.dtype}")
    elif not head_dims_served(problem.dtype, problem.head_dim, problem.head_dim_v):
        reasons.append(f"the Hopper selection kernel takes head dims that are multiples of 16 up to 256, got "
                       f"{problem.head_dim} and {problem.head_dim_v}")
    if not selection_tile_positions(problem.group):
        reasons.append(f"the Hopper selection kernel packs GQA groups of 2 to 64 heads that divide 64 (a query "
                       f"tile's rows), got {problem.heads_q} query heads over {problem.heads_k}")
    tile_n = SELECTION_TILE[1]
    if problem.select_block > tile_n and problem.select_block % tile_n:
        reasons.append(f"the Hopper selection kernel takes selection blocks of at most {tile_n} keys or a multiple "
                       f"of {tile_n}, got {problem.select_block}")
    return reasons


def config_of(problem: SelectionProblem):
    return selection_config(problem.dtype, problem.head_dim, problem.head_dim_v, problem.group, problem.select_block)


class HopperSelectionRunner:
    """A compiled selection kernel and its per-call preparation."""

    def __init__(self, problem: SelectionProblem):
        self.cfg = config_of(problem)
        self.compiled: Callable = disk_cache.load_or_compile(self.cfg, compile_forward)

    def __call__(self, problem: SelectionProblem, q, k, v, selected, cu_seqlens, softmax_scale: float):
        """(o (T, H_q, D_v), lse (H_q, T) fp32) of selection attention on packed q (T, H_q, D),
        k (T, H_k, D), v (T, H_k, D_v) and ``selected`` (T, H_k, n)."""
        cfg = self.cfg
        total, heads_q, _ = q.shape
        heads_k, group = problem.heads_k, problem.group
        out = q.new_empty((total, heads_q, problem.head_dim_v))
        lse = torch.empty((heads_q, total), dtype=torch.float32, device=q.device)
        if total == 0:
            return out, lse
        visits = selection_visits(selected, cu_seqlens, problem.select_block, selection_tile_positions(group),
                                  cfg.tile_n)
        rows = total * group
        q_rows = split_kv.pack_gqa(q[None], heads_k)  # (1, T * g, H_k, D): row t * g + j is head h * g + j
        o_rows = q.new_empty((1, rows, heads_k, problem.head_dim_v))
        lse_rows = torch.empty((1, heads_k, rows), dtype=torch.float32, device=q.device)
        self.compiled(*ForwardArgs(
            mQ=q_rows, mK=k[None], mV=v[None], mO=o_rows, mLSE=lse_rows, mBlockLists=visits.as_lists(),
            max_seqlen_q=rows, scale_log2=softmax_scale * math.log2(math.e), output_scale=1.0,
            num_ctas=sm_count(q.device)))
        split_kv.unpack_gqa(o_rows, lse_rows, total, out[None], lse[None])
        return out, lse


def why_unsupported_selection_backward(problem: SelectionProblem) -> list:
    """Every reason the selection backward kernel cannot run ``problem``."""
    reasons = []
    d, d_v = problem.head_dim, problem.head_dim_v
    if problem.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the Hopper selection backward takes float16/bfloat16 inputs, not {problem.dtype}")
        return reasons
    # past 128, a warpgroup's dK or dV of 64 keys beside S^T and dP^T spills registers
    if not (backward_head_dim_served(d) and backward_head_dim_served(d_v) and max(d, d_v) <= 128):
        reasons.append(f"the Hopper selection backward takes head dims that are multiples of 32 up to 128, got "
                       f"{d} and {d_v}")
        return reasons
    if problem.select_block % 64:
        reasons.append(f"the Hopper selection backward takes selection blocks that are multiples of 64 keys (one "
                       f"consumer warpgroup's), got {problem.select_block}")
    if not selection_backward_tile_positions(problem.dtype, d, d_v, problem.group):
        reasons.append(f"the Hopper selection backward packs GQA groups that divide its query tile and leave at "
                       f"most 32 positions in it, got {problem.heads_q} query heads over {problem.heads_k}")
    return reasons


def backward_config_of(problem: SelectionProblem, options: KernelOptions = KernelOptions()):
    return selection_backward_config(problem.dtype, problem.head_dim, problem.head_dim_v, problem.group,
                                     deterministic=options.deterministic)


def _rows(x: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(T, H_q, D) -> (T * g, H_k, D): row t * g + j of K/V head h is token t of head h * g + j."""
    return split_kv.pack_gqa(x[None], heads_k)[0]


def _lse_rows(lse: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(H_q, T) -> (H_k, T * g), in ``_rows``' order."""
    heads_q, total = lse.shape
    return lse.view(heads_k, heads_q // heads_k, total).transpose(1, 2).reshape(heads_k, -1)


class HopperSelectionBackwardRunner:
    """The compiled selection backward (with its row pass and dQ conversion) and its per-call
    preparation."""

    def __init__(self, problem: SelectionProblem, options: KernelOptions = KernelOptions()):
        self.cfg = backward_config_of(problem, options)
        self.runner = HopperBackwardRunner(self.cfg, disk_cache.load_or_compile(self.cfg, compile_backward))

    def __call__(self, problem: SelectionProblem, dout, q, k, v, out, lse, dlse, selected, cu_seqlens,
                 softmax_scale: float, grads=None):
        """(dq, dk, dv) of selection attention on packed tokens; ``lse``/``dlse`` (H_q, T); into
        ``grads`` (three tensors shaped as q, k, v) where given."""
        total, heads_q, _ = q.shape
        heads_k, group = problem.heads_k, problem.group
        dq, dk, dv = grads if grads is not None else (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        if total == 0:
            return dq, dk, dv
        cfg = self.cfg
        visits = selection_backward_visits(selected, cu_seqlens, problem.select_block, cfg.tile_m // group,
                                           cfg.tile_n, cfg.list_pieces,
                                           sm_count(q.device) if q.is_cuda else HOPPER_SMS)
        # split lists' CTAs add dK and dV here (fp32); their keys are converted after the kernel.
        # Without splits the kernel never touches them: no zeroing, no conversion
        splits = cfg.list_pieces > 1
        accumulator = torch.zeros if splits else torch.empty
        dk_acc = accumulator(k.shape, dtype=torch.float32, device=k.device)
        dv_acc = accumulator(v.shape, dtype=torch.float32, device=v.device)
        rows = total * group
        packed = AttentionProblem(
            dtype=q.dtype, out_dtype=q.dtype, head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
            num_heads_q=heads_k, num_heads_k=heads_k, mask=MaskSpec(), varlen=True, return_lse=True,
            batch=cu_seqlens.numel() - 1, seqlen_q=rows, seqlen_k=total, total_q=rows, total_k=total,
            softmax_scale=softmax_scale, device=q.device)
        dq_rows = q.new_empty((rows, heads_k, problem.head_dim))
        lists, order = tuple(visits) + (dk_acc, dv_acc), None
        if cfg.deterministic:  # the tiles in sequence order, each add's turn (bwd.py)
            order = selection_backward_order(visits, tile_capacity(total, packed.batch, cfg.tile_n), heads_k,
                                             cfg.tile_n, dq_layout.varlen_tiles(rows, packed.batch, cfg.tile_m))
            lists += (order.turns, order.dkv_turns)
        self.runner(packed, _rows(dout, heads_k), _rows(q, heads_k), k, v, _rows(out, heads_k),
                    _lse_rows(lse, heads_k), None if dlse is None else _lse_rows(dlse, heads_k), dq_rows, dk, dv,
                    cu_seqlens * group, cu_seqlens, query_lists=lists, order=order)
        if splits:
            split = split_key_rows(visits, cu_seqlens, total, heads_k, cfg.tile_n)[..., None]
            dk.copy_(torch.where(split, dk_acc.to(dk.dtype), dk))
            dv.copy_(torch.where(split, dv_acc.to(dv.dtype), dv))
        split_kv.unpack_gqa(dq_rows[None], None, total, dq[None], None)
        return dq, dk, dv
