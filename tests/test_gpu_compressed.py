"""Compressed causal with NSA's geometry, ``compressed_causal=(block, stride)`` (key j, the
summary of tokens [j * stride, j * stride + block), kept by row i when j * stride + block - 1 <=
i), on the Hopper kernels through the public API with ``backend="kernel"``, against the fp64
reference: forward and backward, dense and varlen (empty, short and ragged sequences), GQA, the
overlapping paper geometry (32, 16) and others, the ratio form (True) beside it. Outputs and
gradients are poisoned with NaN first. Marked ``gpu``; skipped without a Hopper GPU."""

import math

import pytest
import torch

import fmha
from fmha.masking import MaskSpec
from fmha.reference import attention_backward_reference, attention_reference
from gpu_checks import cu_seqlens, lse_max_err, rel_l2

pytestmark = pytest.mark.gpu
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_needs_hopper = pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (SM90) GPU")



def _summaries(tokens: int, block: int, stride: int) -> int:
    return max(0, (tokens - block) // stride + 1)


def _data(n_q, n_k, heads_q, heads_k, d, dtype, gen, leading=()):
    q = torch.randn(*leading, n_q, heads_q, d, generator=gen, device="cuda").to(dtype)
    k = torch.randn(*leading, n_k, heads_k, d, generator=gen, device="cuda").to(dtype)
    v = torch.randn(*leading, n_k, heads_k, d, generator=gen, device="cuda").to(dtype)
    return q, k, v


# the paper's overlapping geometry, the non-overlapping one, a dense stride and an odd one
CASES = [((32, 16), 128, "dense"), ((32, 16), 128, "varlen"), ((32, 16), 64, "varlen"), ((64, 64), 128, "dense"),
         ((64, 64), 64, "varlen"), ((16, 4), 64, "dense"), ((5, 3), 128, "varlen")]


@_needs_hopper
@pytest.mark.parametrize("geometry,d,layout", CASES, ids=[f"l{g[0]}d{g[1]}-D{d}-{lay}" for g, d, lay in CASES])
def test_forward_and_backward(geometry, d, layout):
    block, stride = geometry
    gen = torch.Generator(device="cuda").manual_seed(block * 7 + stride + d)
    dtype = torch.bfloat16
    if layout == "dense":
        tokens = 1000
        q, k, v = _data(tokens, _summaries(tokens, block, stride), 8, 2, d, dtype, gen, leading=(2,))
        cu_q = cu_k = None
    else:
        lens_q = [0, 1, block - 1, block, 700, 333]
        lens_k = [_summaries(t, block, stride) for t in lens_q]
        q, k, v = _data(sum(lens_q), sum(lens_k), 8, 2, d, dtype, gen)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    mask = MaskSpec.from_args(compressed_causal=geometry)
    out = torch.full(q.shape, math.nan, dtype=dtype, device="cuda")
    lse = torch.full(((2, 8, q.shape[1]) if cu_q is None else (8, q.shape[0])), math.nan, device="cuda")
    call = dict(compressed_causal=geometry, backend="kernel")
    if cu_q is None:
        fmha.attention(q, k, v, out=out, lse=lse, **call)
    else:
        fmha.attention_varlen(q, k, v, cu_q, cu_k, out=out, lse=lse, **call)
    want_o, want_lse = attention_reference(q, k, v, cu_q, cu_k, mask=mask, compute_dtype=torch.float64)
    assert rel_l2(out, want_o) < 1e-2
    assert lse_max_err(lse, want_lse) < 5e-3

    dout = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    args = (dout, q, k, v, out, lse) + (() if cu_q is None else (cu_q, cu_k))
    got = fmha.attention_backward(*args, dq=grads[0], dk=grads[1], dv=grads[2], **call)
    want = attention_backward_reference(dout, q, k, v, out, lse, cu_q, cu_k, mask=mask, compute_dtype=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_l2(g, w) < 2e-2, f"{name}: {rel_l2(g, w):.3g}"


@_needs_hopper
def test_geometry_equal_to_the_ratio_form():
    """(c, c) and True (c = S_q // S_k) are one mask where S_q = c * S_k: the same outputs."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = _data(64 * 13, 13, 4, 4, 128, torch.bfloat16, gen, leading=(2,))
    a = fmha.attention(q, k, v, compressed_causal=(64, 64), backend="kernel")
    b = fmha.attention(q, k, v, compressed_causal=True, backend="kernel")
    assert torch.equal(a, b)
