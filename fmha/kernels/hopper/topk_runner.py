"""The host side of NSA's fused top-k (``kernels/common/block_topk.py``) on Hopper: what it
serves, its compile for sm_90a, and a call's preparation (each token's sequence, inputs too small
for one tile padded). Nothing is read on the host, so a CUDA graph captures it."""

from __future__ import annotations

import math
from typing import Callable

import torch

from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_rows, fake_vector

from .config import ARCH

#: shared memory a CTA may take on Hopper (227 KB)
SHARED_BYTES = 227 * 1024
MAX_SELECT_COUNT = 32


def score_capacity(max_seqlen: int, select_block: int) -> int:
    """Selection blocks held per token: a power of two (so few configurations compile), at
    least 32 (a warp's lanes) and at least the longest sequence's."""
    blocks = max(1, -(-max_seqlen // select_block))
    return max(32, 1 << (blocks - 1).bit_length())


def config_of(problem):
    from ..common.block_topk import BlockTopKConfig

    return BlockTopKConfig(problem.dtype, problem.head_dim, problem.heads_q // problem.heads_k, problem.block,
                           problem.stride, problem.select_block, problem.select_count,
                           score_capacity(problem.max_seqlen, problem.select_block))


def why_unsupported_topk(problem) -> list:
    """Every reason the fused top-k cannot run ``problem`` (a ``fmha.nsa.topk.TopKProblem``)."""
    reasons = []
    if problem.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the top-k kernel takes float16/bfloat16 queries, not {problem.dtype}")
    if problem.head_dim % 16 or not 16 <= problem.head_dim <= 256:
        reasons.append(f"the top-k kernel takes head dims that are multiples of 16 up to 256, got {problem.head_dim}")
    group = problem.heads_q // problem.heads_k
    if 64 % group:
        reasons.append(f"the top-k kernel packs GQA groups that divide 64 (its tile's rows), got {group}")
    if problem.select_count > MAX_SELECT_COUNT:
        reasons.append(f"the top-k kernel ranks at most {MAX_SELECT_COUNT} blocks per token (a warp's lanes), got "
                       f"select_count={problem.select_count}")
    if not reasons:
        need = config_of(problem).shared_bytes()
        if need > SHARED_BYTES:
            reasons.append(f"the top-k kernel holds each token's selection-block scores in shared memory: "
                           f"{need} bytes for sequences of up to {problem.max_seqlen} tokens, over {SHARED_BYTES}")
    return reasons


def compile_block_topk(cfg, extra_options: str = ""):
    """Compile the fused top-k for sm_90a: q and the compressed keys with a unit innermost stride
    and 16-byte aligned rows, the LSE with a unit innermost stride."""
    import cutlass
    from cutlass import Float32

    from ..common.block_topk import BlockTopK

    elem = cutlass_dtype(cfg.dtype)
    q, k = (fake_rows(elem, 3, cfg.head_dim) for _ in range(2))
    lse = fake_rows(cutlass.Float32, 2, None, align_bytes=4)
    out = fake_rows(cutlass.Int32, 3, None, align_bytes=4)
    return compile_for(ARCH, BlockTopK(cfg), q, k, lse, fake_vector(cutlass.Int32), fake_vector(cutlass.Int32),
                       fake_vector(cutlass.Int32), out, Float32(1.0), extra_options=extra_options)


def _padded_rows(t: torch.Tensor, rows: int, dim: int = 0, value: float = 0.0) -> torch.Tensor:
    """``t`` with at least ``rows`` entries along ``dim`` (the kernel's tiles never read past
    the end): the extra ones ``value``."""
    if t.shape[dim] >= rows:
        return t
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim)


class HopperTopKRunner:
    """A compiled fused top-k and its per-call preparation."""

    def __init__(self, problem):
        self.cfg = config_of(problem)
        self.compiled: Callable = disk_cache.load_or_compile(self.cfg, compile_block_topk)

    def __call__(self, problem, q, k_cmp, lse_cmp, cu_seqlens, cu_seqlens_cmp, softmax_scale: float):
        """int32 (T, H_k, select_count) block lists of packed q (T, H_q, D), compressed keys
        (T_c, H_k, D) and the compression LSE (H_q, T)."""
        from fmha.nsa.layout import token_positions
        from fmha.validation import kernel_layout

        cfg = self.cfg
        tokens, heads_k = q.shape[0], k_cmp.shape[1]
        if tokens == 0:
            return torch.full((0, heads_k, cfg.select_count), -1, dtype=torch.int32, device=q.device)
        seq_of = token_positions(cu_seqlens, tokens).sequence.to(torch.int32)
        rows = max(tokens, cfg.tokens_per_tile)  # tokens past T (cu_seqlens[-1]) are no token's
        q_in = kernel_layout(_padded_rows(q, rows))
        lse_in = _padded_rows(lse_cmp.float(), rows, dim=1, value=float("-inf")).contiguous()
        seq_in = _padded_rows(seq_of, rows, value=0)
        k_in = kernel_layout(_padded_rows(k_cmp, 64))
        out = torch.empty((rows, heads_k, cfg.select_count), dtype=torch.int32, device=q.device)
        self.compiled(q_in, k_in, lse_in, cu_seqlens, cu_seqlens_cmp, seq_in, out,
                      softmax_scale * math.log2(math.e))
        return out[:tokens]
