"""NSA's public functions: the window branch and the gated composition of the three branches
(docs/nsa.md). The branches themselves live in ``compression``, ``topk`` and ``selection``.

Inputs are dense (B, S, H, D) with gates (B, S, H_q), or packed (T, H, D) with ``cu_seqlens`` and
gates (T, H_q). Dense inputs keep every shape static (nothing is read on the host, so
torch.compile traces the whole call; docs/nsa.md on CUDA graphs); packed ones read ``cu_seqlens``
once for the checks, the compressed length and the longest sequence.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import api
from ..backends import check_backend_name
from .checks import (check_compressed_kv, check_geometry, check_int, check_like_q, check_qkv, check_scale,
                     check_selected, read_seqlens)
from .compression import run_compression
from .layout import NSABranches, compressed_cu_seqlens, dense_cu_seqlens, num_compressed_blocks, pack
from .pooling import mean_pool

__all__ = ["window_attention", "nsa_attention"]


def window_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Optional[Tensor] = None, window: int = 512, *,
                     softmax_scale: Optional[float] = None, backend: str = "auto",
                     deterministic: bool = False) -> Tuple[Tensor, Tensor]:
    """The sliding-window branch: query t attends to keys t - window + 1 .. t of its sequence.
    fmha's attention with ``causal=True, window_size=(window - 1, 0)`` (the Hopper kernels on an
    SM90 GPU, fmha's reference elsewhere). Packed with ``cu_seqlens`` (LSE (H_q, T)) or dense
    (LSE (B, H_q, S)); differentiable (bitwise-repeatable with ``deterministic``)."""
    check_int("window", window)
    kw = dict(causal=True, window_size=(window - 1, 0), softmax_scale=softmax_scale, return_lse=True,
              backend=backend, deterministic=deterministic)
    if cu_seqlens is None:
        return api.attention(q, k, v, **kw)
    return api.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, **kw)


def _flatten(o: Tensor, lse: Tensor) -> Tuple[Tensor, Tensor]:
    """A dense call's o (B, S, H, D) and lse (B, H, S) as packed ones: (B*S, H, D), (H, B*S)."""
    return o.reshape((-1,) + tuple(o.shape[2:])), lse.transpose(0, 1).reshape(lse.shape[1], -1)


def _compressed_kv(k, v, k_cmp, v_cmp, cu_seqlens, block, stride):
    """(k_cmp, v_cmp) in the caller's layout: mean-pooled unless given (then checked)."""
    if (k_cmp is None) != (v_cmp is None):
        raise ValueError("pass both k_cmp and v_cmp (your own pooling), or neither (mean pooling)")
    if k_cmp is None:
        return mean_pool(k, cu_seqlens, block, stride)[0], mean_pool(v, cu_seqlens, block, stride)[0]
    if cu_seqlens is None:
        rows = num_compressed_blocks(k.shape[1], block, stride)
    elif torch.compiler.is_compiling():
        rows = k_cmp.shape[0]
    else:
        rows = int(compressed_cu_seqlens(cu_seqlens, block, stride)[-1])
    check_compressed_kv(k_cmp, v_cmp, k, v, rows, block, stride)
    return k_cmp, v_cmp


def _check_call(q, k, v, gates, cu_seqlens, block, stride, select_block, select_count, window, backend,
                selected) -> int:
    """Checks the call; returns the longest sequence's length (0 while torch.compile traces)."""
    check_geometry(block, stride, select_block, select_count, window)
    check_backend_name(backend)
    check_qkv(q, k, v, packed=cu_seqlens is not None)
    for name, g in zip(("g_cmp", "g_slc", "g_win"), gates):
        check_like_q(name, g, q, q.shape[:-1], "one gate per query token and head")
    if cu_seqlens is None:
        return q.shape[1]
    if torch.compiler.is_compiling():
        return 0
    return max(read_seqlens("cu_seqlens", cu_seqlens, q.shape[0], q.device), default=0)


def nsa_attention(q: Tensor, k: Tensor, v: Tensor, g_cmp: Tensor, g_slc: Tensor, g_win: Tensor, *,
                  cu_seqlens: Optional[Tensor] = None, block: int = 32, stride: int = 16, select_block: int = 64,
                  select_count: int = 16, window: int = 512, k_cmp: Optional[Tensor] = None,
                  v_cmp: Optional[Tensor] = None, selected: Optional[Tensor] = None,
                  softmax_scale: Optional[float] = None, backend: str = "auto", return_branches: bool = False,
                  deterministic: bool = False):
    """Native Sparse Attention: ``o = g_cmp*o_cmp + g_slc*o_slc + g_win*o_win`` (docs/nsa.md).

    q (B, S, H_q, D), k (B, S, H_k, D), v (B, S, H_k, D_v), gates (B, S, H_q); or packed
    (T, H, D) / (T, H_q) with ``cu_seqlens`` (int32, B + 1). ``k_cmp``/``v_cmp``: compressed keys
    and values of your own pooling ((B, T_c, H_k, D) dense, (T_c, H_k, D) packed as
    ``mean_pool`` packs them); default mean pooling. ``selected``: (B, S, H_k, n) or (T, H_k, n)
    int32 selection block indices (-1 unused) instead of the top-k. Returns o like q with D_v, in
    q's dtype; with ``return_branches``, ``(o, NSABranches)``. Differentiable in q, k, v, the
    gates, and k_cmp/v_cmp (or through the mean pooling); the top-k's choice is not.
    ``backend`` goes to fmha for the window and compression branches and to
    ``selection_attention`` and to the top-k (``select_blocks``): "kernel" runs every branch and
    the top-k on fmha's kernels or raises ``UnsupportedError``. ``deterministic``: the backward of
    every branch is bitwise-repeatable (the forward always is).
    """
    if deterministic is not False and deterministic is not True:
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    gates = (g_cmp, g_slc, g_win)
    longest = _check_call(q, k, v, gates, cu_seqlens, block, stride, select_block, select_count, window, backend,
                          selected)
    scale = check_scale(softmax_scale, q.shape[-1])
    k_cmp, v_cmp = _compressed_kv(k, v, k_cmp, v_cmp, cu_seqlens, block, stride)
    if selected is not None:
        selected = check_selected(selected, k, cu_seqlens, select_block)

    packed = pack((q, k, v) + gates + (selected,), cu_seqlens)
    qp, kp, vp, gc, gs, gw, sel = packed.tensors
    cu = packed.cu_seqlens
    kc, vc = (t.reshape((-1,) + tuple(t.shape[-2:])) for t in (k_cmp, v_cmp))
    if packed.batch is None:
        cu_cmp = compressed_cu_seqlens(cu, block, stride)
        o_cmp, lse_cmp = run_compression(qp, kc, vc, cu, cu_cmp, block, stride, scale, backend, deterministic)
        o_win, lse_win = window_attention(qp, kp, vp, cu, window, softmax_scale=scale, backend=backend,
                                          deterministic=deterministic)
    else:  # fmha's dense calls read no offsets on the host
        cu_cmp = dense_cu_seqlens(packed.batch, k_cmp.shape[1], q.device)
        o_cmp, lse_cmp = _flatten(*api.attention(q, k_cmp, v_cmp, compressed_causal=(block, stride),
                                                 softmax_scale=scale, return_lse=True, backend=backend,
                                                 deterministic=deterministic))
        o_win, lse_win = _flatten(*window_attention(q, k, v, None, window, softmax_scale=scale, backend=backend,
                                                    deterministic=deterministic))
    if sel is None:
        # the offsets were read on the host above, or made here (dense); under torch.compile the op checks them
        sel = torch.ops.fmha_nsa.select_blocks(qp.detach(), kc.detach(), lse_cmp.detach(), cu, cu_cmp, block, stride,
                                               select_block, select_count, scale, backend, longest,
                                               not torch.compiler.is_compiling())
    o_slc, lse_slc = torch.ops.fmha_nsa.selection_forward(qp, kp, vp, sel, cu, select_block, scale, backend,
                                                          deterministic)

    acc = torch.promote_types(q.dtype, torch.float32)
    o = sum(g.to(acc)[..., None] * branch.to(acc) for g, branch in ((gc, o_cmp), (gs, o_slc), (gw, o_win)))
    o = packed.unpack(o.to(q.dtype))
    if not return_branches:
        return o
    n_cmp = None if packed.batch is None else k_cmp.shape[1]
    return o, NSABranches(
        packed.unpack(o_cmp), packed.unpack_lse(lse_cmp), packed.unpack(o_slc), packed.unpack_lse(lse_slc),
        packed.unpack(o_win), packed.unpack_lse(lse_win), packed.unpack(sel), packed.unpack(kc, n_cmp),
        packed.unpack(vc, n_cmp), cu_cmp if packed.batch is None else None)
