"""The compression branch: each query attends to its sequence's compressed keys/values, block i
being visible to query t iff ``i*stride + block - 1 <= t`` (docs/nsa.md).

That is fmha's mask ``compressed_causal=(block, stride)``, so the branch is fmha's attention:
the Hopper kernels on an SM90 GPU, fmha's PyTorch reference elsewhere (``backend`` says which, as
for fmha). fmha's custom ops (its autograd and torch.compile path) do not take the
``(block, stride)`` form yet, so this module wraps fmha's forward and backward, each called
without autograd, in two custom ops of its own, ``fmha_nsa::compression_forward`` /
``compression_backward``; once fmha.ops takes the pair, ``compression_attention`` can call
``fmha.attention_varlen(..., compressed_causal=(block, stride))`` directly.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import api
from ..problem import accumulate_dtype
from .checks import check_compressed_offsets, check_geometry, check_qkv, check_scale

__all__ = ["compression_attention"]



@torch.library.custom_op("fmha_nsa::compression_forward", mutates_args=())
def _forward_op(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, block: int,
                stride: int, softmax_scale: float, backend: str) -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        return api.attention_varlen(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, compressed_causal=(block, stride),
                                    softmax_scale=softmax_scale, return_lse=True, backend=backend)


@_forward_op.register_fake
def _forward_fake(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, softmax_scale, backend):
    o = q.new_empty(q.shape[:-1] + (v_cmp.shape[-1],))
    return o, q.new_empty((q.shape[1], q.shape[0]), dtype=accumulate_dtype(q.dtype))


@torch.library.custom_op("fmha_nsa::compression_backward", mutates_args=())
def _backward_op(dout: Tensor, q: Tensor, k_cmp: Tensor, v_cmp: Tensor, out: Tensor, lse: Tensor,
                 dlse: Optional[Tensor], cu_seqlens: Tensor, cu_seqlens_cmp: Tensor, block: int, stride: int,
                 softmax_scale: float, backend: str) -> Tuple[Tensor, Tensor, Tensor]:
    return api.attention_backward(dout, q, k_cmp, v_cmp, out, lse, cu_seqlens, cu_seqlens_cmp, dlse=dlse,
                                  compressed_causal=(block, stride), softmax_scale=softmax_scale, backend=backend)


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
    fmha ("auto", "kernel" or "reference")."""
    check_geometry(block, stride)
    scale = _check_call(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, softmax_scale)
    return torch.ops.fmha_nsa.compression_forward(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, scale,
                                                  backend)


def _check_call(q, k_cmp, v_cmp, cu, cu_cmp, block, stride, softmax_scale) -> float:
    check_qkv(q, k_cmp, v_cmp, packed=True, names=("q", "k_cmp", "v_cmp"), same_tokens=False)
    check_compressed_offsets(cu, cu_cmp, q.shape[0], k_cmp.shape[0], block, stride, q.device)
    return check_scale(softmax_scale, q.shape[-1])
