"""The host side of NSA's selection branch on the Hopper forward kernel (``selection_config``):
each packed token's GQA group becomes consecutive query rows of one K/V head (as decode packs
them), the selection lists become each query tile's visits (``fmha.nsa.selection_visits``), and
the packed O and LSE go back to the tokens' layout."""

from __future__ import annotations

import math
from typing import Callable

import torch

from fmha import split_kv
from fmha.jit import disk_cache
from fmha.jit.launch import sm_count
from fmha.nsa.selection_visits import SelectionProblem, selection_visits

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
