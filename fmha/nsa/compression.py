"""The compression branch: each query attends to its sequence's compressed keys/values, block i
being visible to query t iff ``i*stride + block - 1 <= t`` (docs/nsa.md).

It runs as the custom ops ``fmha_nsa::compression_forward`` / ``compression_backward`` (opaque
to torch.compile, with autograd), whose implementation picks the path when it runs:

- ``"fmha"``: fmha's attention with ``compressed_causal=True`` (the Hopper kernels on an SM90
  GPU, fmha's reference elsewhere). That mask is ``j <= (t + 1) // c - 1`` with
  ``c = T // T_c``; it equals this branch iff ``block == stride`` and, for every non-empty
  sequence, ``T_c >= 1`` and ``T // T_c == block``: so not when a sequence is shorter than the
  block, nor when ``T % block >= T // block`` (T=10, block=4: T_c=2 but c=5).
- ``"torch"``: ``_compression_attention_torch`` below, exact, in plain PyTorch, for all the rest.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .. import api
from .checks import check_compressed_offsets, check_geometry, check_qkv, check_scale
from .layout import num_compressed_blocks, visible_compressed_blocks

__all__ = ["compression_attention", "compression_path"]

#: budget of one chunk of scores in the PyTorch path (its dominant temporary)
CHUNK_BYTES = 128 << 20


def compression_path(seqlens: List[int], block: int, stride: int) -> str:
    """Which implementation serves sequences of these lengths: "fmha" or "torch" (module doc)."""
    if block != stride:
        return "torch"
    for n in seqlens:
        n_cmp = num_compressed_blocks(n, block, stride)
        if n > 0 and (n_cmp == 0 or n // n_cmp != block):
            return "torch"
    return "fmha"


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(rows: int, heads: int, keys: int, elem: int) -> int:
    return max(1, min(rows, CHUNK_BYTES // max(1, heads * keys * elem * 4)))


def _band(q, k, hi, scale, cdt):
    """Scores (H_q, rows, keys) of query rows against keys [0, hi(row)), -inf elsewhere."""
    group = q.shape[1] // k.shape[1]
    kh = k.to(cdt).repeat_interleave(group, dim=1)
    s = torch.einsum("rhd,khd->hrk", q.to(cdt), kh) * scale
    keep = torch.arange(k.shape[0], device=q.device)[None, :] < hi[:, None]
    return s.masked_fill(~keep[None], -math.inf)


def _compression_attention_torch(q, k_cmp, v_cmp, cu, cu_cmp, block, stride, scale):
    """(o in q's dtype, lse (H_q, T) in fp32/fp64), one sequence and a bounded chunk at a time."""
    cdt = _accumulate_dtype(q.dtype)
    o = torch.zeros(q.shape[:-1] + (v_cmp.shape[-1],), dtype=cdt, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=cdt, device=q.device)
    offsets, offsets_cmp = cu.tolist(), cu_cmp.tolist()
    group = q.shape[1] // k_cmp.shape[1]
    for b in range(len(offsets) - 1):
        r0, r1, c0, c1 = offsets[b], offsets[b + 1], offsets_cmp[b], offsets_cmp[b + 1]
        step = _chunk_rows(r1 - r0, q.shape[1], c1 - c0, 2)
        for a in range(r0, r1, step):
            z = min(a + step, r1)
            hi = visible_compressed_blocks(torch.arange(a - r0, z - r0, device=q.device), block, stride)
            n_keys = int(hi[-1])  # the chunk's last row sees the most
            if n_keys == 0:
                continue
            s = _band(q[a:z], k_cmp[c0:c0 + n_keys], hi, scale, cdt)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = (s - m).exp()
            total = p.sum(-1, keepdim=True)
            vh = v_cmp[c0:c0 + n_keys].to(cdt).repeat_interleave(group, dim=1)
            pv = torch.einsum("hrk,khd->rhd", p, vh)
            o[a:z] = pv / torch.where(total > 0, total, torch.ones_like(total)).squeeze(-1).T[..., None]
            lse[:, a:z] = torch.where(total > 0, m + total.log(), torch.full_like(m, -math.inf)).squeeze(-1)
    return o.to(q.dtype), lse


def _compression_backward_torch(dout, q, k_cmp, v_cmp, out, lse, dlse, cu, cu_cmp, block, stride, scale):
    """(dq, dk_cmp, dv_cmp) of ``_compression_attention_torch``: P from the saved LSE,
    dS = P * (dP - delta), delta = rowsum(dO * O) - dLSE."""
    cdt = _accumulate_dtype(q.dtype)
    group = q.shape[1] // k_cmp.shape[1]
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k_cmp.shape[:1] + q.shape[1:2] + k_cmp.shape[2:], dtype=cdt, device=q.device)
    dv = torch.zeros(v_cmp.shape[:1] + q.shape[1:2] + v_cmp.shape[2:], dtype=cdt, device=q.device)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1).T  # (H_q, T)
    if dlse is not None:
        delta = delta - dlse.to(cdt)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(cdt)  # P = exp(-inf) = 0 there
    offsets, offsets_cmp = cu.tolist(), cu_cmp.tolist()
    for b in range(len(offsets) - 1):
        r0, r1, c0, c1 = offsets[b], offsets[b + 1], offsets_cmp[b], offsets_cmp[b + 1]
        step = _chunk_rows(r1 - r0, q.shape[1], c1 - c0, 4)
        for a in range(r0, r1, step):
            z = min(a + step, r1)
            hi = visible_compressed_blocks(torch.arange(a - r0, z - r0, device=q.device), block, stride)
            n = int(hi[-1])
            if n == 0:
                continue
            kc = k_cmp[c0:c0 + n].to(cdt).repeat_interleave(group, dim=1)
            vc = v_cmp[c0:c0 + n].to(cdt).repeat_interleave(group, dim=1)
            p = (_band(q[a:z], k_cmp[c0:c0 + n], hi, scale, cdt) - lse[:, a:z, None]).exp()
            do = dout[a:z].to(cdt)
            ds = p * (torch.einsum("rhd,khd->hrk", do, vc) - delta[:, a:z, None])
            dq[a:z] += torch.einsum("hrk,khd->rhd", ds, kc) * scale
            dk[c0:c0 + n] += torch.einsum("hrk,rhd->khd", ds, q[a:z].to(cdt)) * scale
            dv[c0:c0 + n] += torch.einsum("hrk,rhd->khd", p, do)
    # a KV head's gradient sums its group's query heads
    dk = dk.view(dk.shape[0], k_cmp.shape[1], group, -1).sum(2)
    dv = dv.view(dv.shape[0], v_cmp.shape[1], group, -1).sum(2)
    return dq.to(q.dtype), dk.to(k_cmp.dtype), dv.to(v_cmp.dtype)


def _seqlens(cu: Tensor) -> List[int]:
    offsets = cu.tolist()
    return [b - a for a, b in zip(offsets[:-1], offsets[1:])]


@torch.library.custom_op("fmha_nsa::compression_forward", mutates_args=())
def _forward_op(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, block: int,
                stride: int, softmax_scale: float, backend: str) -> Tuple[Tensor, Tensor]:
    if compression_path(_seqlens(cu_seqlens), block, stride) == "fmha":
        with torch.no_grad():
            return api.attention_varlen(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, compressed_causal=True,
                                        softmax_scale=softmax_scale, return_lse=True, backend=backend)
    return _compression_attention_torch(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, softmax_scale)


@_forward_op.register_fake
def _forward_fake(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, softmax_scale, backend):
    o = q.new_empty(q.shape[:-1] + (v_cmp.shape[-1],))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=_accumulate_dtype(q.dtype))


@torch.library.custom_op("fmha_nsa::compression_backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, out: Tensor, lse: Tensor,
                 dlse: Optional[Tensor], cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, block: int, stride: int,
                 softmax_scale: float, backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    if compression_path(_seqlens(cu_seqlens), block, stride) == "fmha":
        return api.attention_backward(dout, q, k_cmp, v_cmp, out, lse, cu_seqlens, cu_seqlens_cmp, dlse=dlse,
                                      compressed_causal=True, softmax_scale=softmax_scale, backend=backend)
    return _compression_backward_torch(dout, q, k_cmp, v_cmp, out, lse, dlse, cu_seqlens, cu_seqlens_cmp, block,
                                       stride, softmax_scale)


@_backward_op.register_fake
def _backward_fake(dout, q, k_cmp, v_cmp, out, lse, dlse, cu_seqlens, cu_seqlens_cmp, block, stride,
                   softmax_scale, backend):
    return torch.empty_like(q), torch.empty_like(k_cmp), torch.empty_like(v_cmp)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)
    q, k_cmp, v_cmp, cu, cu_cmp, block, stride, scale, backend = inputs
    ctx.args = (block, stride, scale, backend)
    ctx.save_for_backward(q, k_cmp, v_cmp, cu, cu_cmp, *output)


def _backward(ctx, dout, dlse):
    q, k_cmp, v_cmp, cu, cu_cmp, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fmha_nsa.compression_backward(dout.contiguous(), q, k_cmp, v_cmp, out, lse, dlse, cu,
                                                         cu_cmp, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def compression_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                          block: int = 32, stride: int = 16, *, softmax_scale: Optional[float] = None,
                          backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The compression branch on packed tensors: q (T, H_q, D) with ``cu_seqlens``, k_cmp
    (T_c, H_k, D) / v_cmp (T_c, H_k, D_v) with ``cu_seqlens_cmp`` (``mean_pool``'s layout).
    Returns o (T, H_q, D_v) in q's dtype and lse (H_q, T) fp32 (fp64 for fp64 inputs); a query
    that sees no block gets 0 and -inf. Differentiable in q, k_cmp, v_cmp; ``backend`` goes to
    fmha where it serves the call (module doc)."""
    check_geometry(block, stride)
    scale = _check_call(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, softmax_scale)
    return torch.ops.fmha_nsa.compression_forward(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, scale,
                                                  backend)


def _check_call(q, k_cmp, v_cmp, cu, cu_cmp, block, stride, softmax_scale) -> float:
    check_qkv(q, k_cmp, v_cmp, packed=True, names=("q", "k_cmp", "v_cmp"), same_tokens=False)
    check_compressed_offsets(cu, cu_cmp, q.shape[0], k_cmp.shape[0], block, stride, q.device)
    return check_scale(softmax_scale, q.shape[-1])
