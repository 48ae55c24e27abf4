"""The compression branch: each query attends to its sequence's compressed keys/values, block i
being visible to query t iff ``i*stride + block - 1 <= t`` (docs/nsa.md).

That is fmha's mask ``compressed_causal=(block, stride)``, so the branch is fmha's attention with
autograd and torch.compile support as fmha gives them: the Hopper kernels on an SM90 GPU,
fmha's PyTorch reference elsewhere (``backend`` says which, as for fmha).
"""

from __future__ import annotations

from typing import Optional, Tuple

from torch import Tensor

from .. import api
from .checks import check_compressed_offsets, check_geometry, check_qkv, check_scale

__all__ = ["compression_attention"]


def run_compression(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, scale, backend, deterministic=False):
    """The branch on checked arguments (``nsa_attention`` checks once for every branch)."""
    return api.attention_varlen(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, compressed_causal=(block, stride),
                                softmax_scale=scale, return_lse=True, backend=backend, deterministic=deterministic)


def compression_attention(q: Tensor, k_cmp: Tensor, v_cmp: Tensor, cu_seqlens: Tensor, cu_seqlens_cmp: Tensor,
                          block: int = 32, stride: int = 16, *, softmax_scale: Optional[float] = None,
                          backend: str = "auto") -> Tuple[Tensor, Tensor]:
    """The compression branch on packed tensors: q (T, H_q, D) with ``cu_seqlens``, k_cmp
    (T_c, H_k, D) / v_cmp (T_c, H_k, D_v) with ``cu_seqlens_cmp`` (``mean_pool``'s layout).
    Returns o (T, H_q, D_v) in q's dtype and lse (H_q, T) fp32 (fp64 for fp64 inputs); a query
    that sees no block gets 0 and -inf. Differentiable in q, k_cmp, v_cmp; ``backend`` goes to
    fmha ("auto", "kernel" or "reference")."""
    check_geometry(block, stride)
    check_qkv(q, k_cmp, v_cmp, packed=True, names=("q", "k_cmp", "v_cmp"), same_tokens=False)
    check_compressed_offsets(cu_seqlens, cu_seqlens_cmp, q.shape[0], k_cmp.shape[0], block, stride, q.device)
    scale = check_scale(softmax_scale, q.shape[-1])
    return run_compression(q, k_cmp, v_cmp, cu_seqlens, cu_seqlens_cmp, block, stride, scale, backend)
