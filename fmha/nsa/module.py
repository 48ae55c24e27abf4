"""``NativeSparseAttention``: an NSA attention layer on hidden states (B, S, hidden), as
flash-linear-attention's layer is built: q/k/v projections, rotary position embedding on q and k
(before the pooling, so compressed keys pool rotated keys), one sigmoid gate per query head and
branch from a linear map of the hidden states, the three branches, the output projection."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .checks import check_geometry, check_int
from .functional import nsa_attention
from .layout import token_positions
from .pooling import MLPPool
from .reference import nsa_reference

__all__ = ["NativeSparseAttention", "apply_rotary"]


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding, the rotate-half (GPT-NeoX) layout: dims i and i + D/2 of x (..., H, D)
    at position p turn by p * base^(-2i/D). ``positions`` has x's leading token dims; the
    angles are computed in fp32 (fp64 for fp64 x)."""
    half = x.shape[-1] // 2
    acc = torch.promote_types(x.dtype, torch.float32)
    inv_freq = base ** (-torch.arange(half, device=x.device, dtype=acc) * 2 / x.shape[-1])
    angle = positions.to(acc)[..., None, None] * inv_freq  # (..., 1, D/2)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x[..., :half].to(acc), x[..., half:2 * half].to(acc)
    turned = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half:].to(acc)], dim=-1)
    return turned.to(x.dtype)


class NativeSparseAttention(nn.Module):
    """NSA over hidden states: ``forward(x)`` with x (B, S, hidden_size), or x (1, T, hidden_size)
    packed with ``cu_seqlens`` (positions restart at every sequence). Returns (B, S, hidden_size).

    ``pooling``: "mean" (parameter-free) or "mlp" (``MLPPool``, one for keys and one for values).
    ``rotary``: RoPE (base ``rope_theta``) on q and k. ``implementation``: "fmha" runs
    ``nsa_attention`` (fmha's kernels where they serve, PyTorch elsewhere; ``backend`` goes to
    it); "reference" runs ``fmha.nsa.reference.nsa_reference`` in fp64 (the oracle, slow; for
    checking a model), returning the result in the input's dtype. ``deterministic``: a
    bitwise-repeatable backward (``nsa_attention``'s).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, *, block: int = 32, stride: int = 16, select_block: int = 64,
                 select_count: int = 16, window: int = 512, pooling: str = "mean", rotary: bool = True,
                 rope_theta: float = 10000.0, qkv_bias: bool = False, implementation: str = "fmha",
                 backend: str = "auto", deterministic: bool = False):
        super().__init__()
        check_geometry(block, stride, select_block, select_count, window)
        self.hidden_size = check_int("hidden_size", hidden_size)
        self.num_heads = check_int("num_heads", num_heads)
        self.num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.head_dim = hidden_size // num_heads if head_dim is None else check_int("head_dim", head_dim)
        if pooling not in ("mean", "mlp"):
            raise ValueError(f"pooling must be 'mean' or 'mlp', got {pooling!r}")
        if implementation not in ("fmha", "reference"):
            raise ValueError(f"implementation must be 'fmha' or 'reference', got {implementation!r}")
        self.block, self.stride, self.select_block = block, stride, select_block
        self.select_count, self.window = select_count, window
        self.pooling, self.rotary, self.rope_theta = pooling, rotary, rope_theta
        self.implementation, self.backend = implementation, backend
        if deterministic is not False and deterministic is not True:
            raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
        self.deterministic = deterministic

        d, hq, hk = self.head_dim, self.num_heads, self.num_kv_heads
        self.q_proj = nn.Linear(hidden_size, hq * d, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, hk * d, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, hk * d, bias=qkv_bias)
        self.g_proj = nn.Linear(hidden_size, hq * 3, bias=False)  # (cmp, slc, win) per head
        self.o_proj = nn.Linear(hq * d, hidden_size, bias=False)
        if pooling == "mlp":
            self.k_pool = MLPPool(d, block, stride)
            self.v_pool = MLPPool(d, block, stride)

    def _positions(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
        if cu_seqlens is None:
            return torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        return token_positions(cu_seqlens, x.shape[1]).position[None]

    def forward(self, x: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be (B, S, {self.hidden_size}), got {tuple(x.shape)}")
        if cu_seqlens is not None and x.shape[0] != 1:
            raise ValueError(f"with cu_seqlens, x holds the packed sequences as (1, T, hidden); got batch {x.shape[0]}")
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        g_cmp, g_slc, g_win = self.g_proj(x).view(b, s, self.num_heads, 3).sigmoid().unbind(-1)
        if self.rotary:
            positions = self._positions(x, cu_seqlens)
            q, k = apply_rotary(q, positions, self.rope_theta), apply_rotary(k, positions, self.rope_theta)
        if cu_seqlens is not None:  # the functions take packed tensors without the batch dim
            q, k, v, g_cmp, g_slc, g_win = (t[0] for t in (q, k, v, g_cmp, g_slc, g_win))
        k_cmp = v_cmp = None
        if self.pooling == "mlp":
            k_cmp, v_cmp = self.k_pool(k, cu_seqlens)[0], self.v_pool(v, cu_seqlens)[0]
        kw = dict(cu_seqlens=cu_seqlens, block=self.block, stride=self.stride, select_block=self.select_block,
                  select_count=self.select_count, window=self.window, k_cmp=k_cmp, v_cmp=v_cmp)
        if self.implementation == "reference":
            o = nsa_reference(q, k, v, g_cmp, g_slc, g_win, **kw).to(q.dtype)
        else:
            o = nsa_attention(q, k, v, g_cmp, g_slc, g_win, backend=self.backend, deterministic=self.deterministic,
                              **kw)
        return self.o_proj(o.reshape(b, s, -1))

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, block={self.block}, "
                f"stride={self.stride}, select_block={self.select_block}, select_count={self.select_count}, "
                f"window={self.window}, pooling={self.pooling!r}, implementation={self.implementation!r}")
