"""The compression branch's pooling: from each sequence's keys (or values), one vector per
compressed block of ``block`` tokens every ``stride`` tokens (docs/nsa.md). Mean pooling, and the
paper's learnable MLP over a block's tokens with an intra-block position encoding. Both are plain
torch operations, differentiable by autograd.

Packed input (T, H, D) with ``cu_seqlens`` gives (T_c, H, D) packed per sequence with its offsets
``cu_seqlens_cmp``; the total T_c is read from the offsets on the host (so torch.compile breaks
the graph there). Dense input (B, S, H, D) gives (B, T_c, H, D) and ``None`` offsets, with static
shapes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from .checks import INPUT_DTYPES, check_geometry, check_int, read_seqlens
from .layout import compressed_cu_seqlens, num_compressed_blocks

__all__ = ["compressed_blocks", "mean_pool", "MLPPool"]


def _check_input(x, cu_seqlens) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x is {x.dtype}; pooling takes float16, bfloat16, float32 or float64")
    rank = 3 if cu_seqlens is not None else 4
    if x.dim() != rank:
        layout = "(T, H, D) with cu_seqlens" if rank == 3 else "(B, S, H, D) without cu_seqlens"
        raise ValueError(f"x must have {rank} dims {layout}, got shape {tuple(x.shape)}")


def compressed_blocks(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor], block: int,
                      stride: int) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The tokens of every compressed block: (T_c, block, H, D) packed with ``cu_seqlens_cmp``,
    or (B, T_c, block, H, D) and None for dense x (a strided view, no copy)."""
    check_geometry(block, stride)
    _check_input(x, cu_seqlens)
    if cu_seqlens is None:
        n_cmp = num_compressed_blocks(x.shape[1], block, stride)
        if n_cmp == 0:  # unfold refuses a window longer than the sequence
            return x.new_zeros((x.shape[0], 0, block) + tuple(x.shape[2:])), None
        return x.unfold(1, block, stride).movedim(-1, 2), None
    if not torch.compiler.is_compiling():
        read_seqlens("cu_seqlens", cu_seqlens, x.shape[0], x.device)
    cu_cmp = compressed_cu_seqlens(cu_seqlens, block, stride)
    total = int(cu_cmp[-1])  # host sync: the output's size
    blocks = torch.arange(total, device=x.device)
    seq = torch.searchsorted(cu_cmp[1:].long(), blocks, right=True)
    first = cu_seqlens.long()[seq] + (blocks - cu_cmp.long()[seq]) * stride
    rows = first[:, None] + torch.arange(block, device=x.device)
    return x[rows], cu_cmp


def mean_pool(x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, block: int = 32,
              stride: int = 16) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(x_cmp, cu_seqlens_cmp): compressed block i of a sequence is the mean of its tokens
    [i*stride, i*stride + block), accumulated in fp32 (fp64 for fp64) and returned in x's dtype.
    ``cu_seqlens_cmp`` is None for dense x."""
    blocks, cu_cmp = compressed_blocks(x, cu_seqlens, block, stride)
    acc = torch.promote_types(x.dtype, torch.float32)
    return blocks.mean(dim=-3, dtype=acc).to(x.dtype), cu_cmp


class MLPPool(nn.Module):
    """The paper's learnable compression: a block's ``block`` tokens plus a learned intra-block
    position encoding (one vector per position in the block), flattened per head and mapped by a
    two-layer MLP (GELU) to one vector. The MLP is shared by the heads. ``hidden`` defaults to
    4 * head_dim, ``out_dim`` to head_dim. Computes in its parameters' dtype and returns x's."""

    def __init__(self, head_dim: int, block: int = 32, stride: int = 16, out_dim: Optional[int] = None,
                 hidden: Optional[int] = None):
        super().__init__()
        check_geometry(block, stride)
        self.head_dim = check_int("head_dim", head_dim)
        self.block, self.stride = block, stride
        out_dim = head_dim if out_dim is None else check_int("out_dim", out_dim)
        hidden = 4 * head_dim if hidden is None else check_int("hidden", hidden)
        self.position = nn.Parameter(torch.randn(block, head_dim) * 0.02)
        self.mlp = nn.Sequential(nn.Linear(block * head_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None):
        """(x_cmp, cu_seqlens_cmp) in the layout of :func:`mean_pool`."""
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"x has head dim {x.shape[-1]} but this MLPPool was built for {self.head_dim}")
        blocks, cu_cmp = compressed_blocks(x, cu_seqlens, self.block, self.stride)
        blocks = blocks.to(self.position.dtype) + self.position[:, None, :]  # (..., T_c, block, H, D)
        flat = blocks.movedim(-3, -2).flatten(-2)  # (..., T_c, H, block * D)
        return self.mlp(flat).to(x.dtype), cu_cmp

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, block={self.block}, stride={self.stride}"
