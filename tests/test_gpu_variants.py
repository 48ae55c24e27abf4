"""The attention variants on the Hopper kernels (softcap, sinks, negative window sides, causal
clipping a window), through the public API with ``backend="kernel"`` (no fallback), against the
fp64 reference: dense and varlen (empty and length-1 sequences), GQA, the decode path over a
paged cache with and without split-KV, and the backward (dq, dk, dv and the sinks' gradient),
deterministic too. Outputs and gradients are poisoned with NaN first, so unwritten elements show.
Marked ``gpu``; skipped without a Hopper GPU."""

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

MASKS = {
    "none": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(100, 37)),
    "neg_right_br": dict(window_size=(None, -5), mask_align="bottom_right"),
    "neg_left": dict(window_size=(-3, 40)),
    "causal_clip": dict(causal=True, window_size=(64, 8)),
}
VARIANTS = {"softcap": (7.5, False), "sinks": (0.0, True), "both": (2.5, True), "plain": (0.0, False)}


def _data(shape_q, shape_k, dtype, gen):
    q = torch.randn(shape_q, generator=gen, device="cuda").to(dtype)
    k = torch.randn(shape_k, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape_k, generator=gen, device="cuda").to(dtype)
    return q, k, v


FORWARD = [(dt, d, m, var, layout)
           for dt in (torch.bfloat16, torch.float16) for d in (64, 128, 256)
           for m in MASKS for var in ("softcap", "sinks", "both")
           for layout in ("dense", "varlen")
           if not (dt == torch.float16 and (d == 256 or layout == "varlen"))]


@_needs_hopper
@pytest.mark.parametrize("dtype,d,mask,variant,layout", FORWARD,
                         ids=[f"{str(a).split('.')[-1]}-D{b}-{c}-{e}-{f}" for a, b, c, e, f in FORWARD])
def test_forward(dtype, d, mask, variant, layout):
    softcap, with_sinks = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(d + len(mask) + len(variant))
    sinks = (torch.randn(8, generator=gen, device="cuda") * 2) if with_sinks else None
    kw = dict(MASKS[mask], softcap=softcap, sinks=sinks)
    if layout == "dense":
        q, k, v = _data((2, 333, 8, d), (2, 301, 2, d), dtype, gen)
        cu_q = cu_k = None
        out = torch.full(q.shape, math.nan, dtype=dtype, device="cuda")
        lse = torch.full((2, 8, 333), math.nan, device="cuda")
        fmha.attention(q, k, v, out=out, lse=lse, backend="kernel", **kw)
    else:
        lens_q, lens_k = [0, 1, 200, 77, 1], [5, 1, 260, 0, 300]
        q, k, v = _data((sum(lens_q), 8, d), (sum(lens_k), 2, d), dtype, gen)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        out = torch.full(q.shape, math.nan, dtype=dtype, device="cuda")
        lse = torch.full((8, sum(lens_q)), math.nan, device="cuda")
        fmha.attention_varlen(q, k, v, cu_q, cu_k, out=out, lse=lse, backend="kernel", **kw)
    want_o, want_lse = attention_reference(q, k, v, cu_q, cu_k, mask=MaskSpec.from_args(**MASKS[mask]),
                                           softcap=softcap, sinks=sinks, compute_dtype=torch.float64)
    assert rel_l2(out, want_o) < 1e-2
    assert lse_max_err(lse, want_lse) < 5e-3


DECODE = [(d, page, splits, var, s_q, mask) for d in (64, 128) for page in (0, 64) for splits in (1, 3)
          for var in ("softcap", "sinks", "both") for s_q in (1, 4) for mask in ("causal", "neg_right_br")]


@_needs_hopper
@pytest.mark.parametrize("d,page,splits,variant,s_q,mask", DECODE,
                         ids=[f"D{a}-page{b}-splits{c}-{e}-sq{f}-{g}" for a, b, c, e, f, g in DECODE])
def test_decode(d, page, splits, variant, s_q, mask):
    softcap, with_sinks = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(d + page + splits)
    b, hq, hk, cap = 3, 8, 2, 640
    sinks = (torch.randn(hq, generator=gen, device="cuda") * 2) if with_sinks else None
    q = torch.randn(b, s_q, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, cap, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, cap, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
    lengths = torch.tensor([0, 130, 617], dtype=torch.int32, device="cuda")
    table = None
    k_cache, v_cache = k, v
    if page:
        n = cap // page
        perm = torch.randperm(b * n, generator=torch.Generator().manual_seed(1)).to("cuda")
        table = perm.view(b, n).to(torch.int32)
        k_cache = torch.empty(b * n, page, hk, d, dtype=k.dtype, device="cuda")
        v_cache = torch.empty_like(k_cache)
        k_cache[perm] = k.view(b * n, page, hk, d)
        v_cache[perm] = v.view(b * n, page, hk, d)
    out = torch.full(q.shape, math.nan, dtype=q.dtype, device="cuda")
    lse = torch.full((b, hq, s_q), math.nan, device="cuda")
    mkw = dict(MASKS[mask])
    mkw.pop("mask_align", None)
    fmha.attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table, out=out, lse=lse,
                                backend="kernel", num_splits=splits, softcap=softcap, sinks=sinks, **mkw)
    mspec = MaskSpec.from_args(**dict(mkw), mask_align="bottom_right")
    for i in range(b):
        n = int(lengths[i])
        wo, wl = attention_reference(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], mask=mspec, softcap=softcap,
                                     sinks=sinks, compute_dtype=torch.float64)
        assert rel_l2(out[i:i + 1], wo) < 1e-2
        assert lse_max_err(lse[i:i + 1], wl) < 5e-3


BACKWARD = [(dt, d, m, var, layout, det)
            for dt in (torch.bfloat16, torch.float16) for d in (64, 128, 256)
            for m in ("none", "causal", "window", "neg_right_br", "causal_clip")
            for var in ("softcap", "sinks", "both") for layout in ("dense", "varlen") for det in (False, True)
            if not (dt == torch.float16 and (d == 256 or layout == "varlen" or det))
            and not (det and (m not in ("causal", "none") or var != "both"))]


@_needs_hopper
@pytest.mark.parametrize("dtype,d,mask,variant,layout,det", BACKWARD,
                         ids=[f"{str(a).split('.')[-1]}-D{b}-{c}-{e}-{f}{'-det' if g else ''}"
                              for a, b, c, e, f, g in BACKWARD])
def test_backward(dtype, d, mask, variant, layout, det):
    softcap, with_sinks = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(3 * d + len(mask))
    sinks = (torch.randn(4, generator=gen, device="cuda") * 2).to(torch.bfloat16) if with_sinks else None
    mspec = MaskSpec.from_args(**MASKS[mask])
    if layout == "dense":
        q, k, v = _data((2, 257, 4, d), (2, 299, 2, d), dtype, gen)
        cu_q = cu_k = None
    else:
        lens_q, lens_k = [0, 1, 190, 65], [4, 1, 0, 200]
        q, k, v = _data((sum(lens_q), 4, d), (sum(lens_k), 2, d), dtype, gen)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    o, lse = attention_reference(q, k, v, cu_q, cu_k, mask=mspec, softcap=softcap, sinks=sinks)
    out = o.to(dtype)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    dsinks = torch.full_like(sinks, math.nan) if with_sinks else None
    kw = dict(MASKS[mask], softcap=softcap, sinks=sinks, deterministic=det, backend="kernel")
    if layout == "dense":
        got = fmha.attention_backward(dout, q, k, v, out, lse, dq=grads[0], dk=grads[1], dv=grads[2],
                                      dsinks=dsinks, **kw)
    else:
        got = fmha.attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, dq=grads[0], dk=grads[1], dv=grads[2],
                                      dsinks=dsinks, **kw)
    want = attention_backward_reference(dout, q, k, v, out, lse, cu_q, cu_k, mask=mspec, softcap=softcap,
                                        sinks=sinks, compute_dtype=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        tol = 3e-2 if name == "dsinks" else 2e-2
        assert rel_l2(g, w) < tol, f"{name}: {rel_l2(g, w):.3g}"
    if det:
        again = fmha.attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw) if layout == "varlen" else \
            fmha.attention_backward(dout, q, k, v, out, lse, **kw)
        for g, h in zip(got, again):
            assert torch.equal(g, h)


@_needs_hopper
@pytest.mark.parametrize("variant", ["softcap", "sinks", "both"])
def test_training_autograd(variant):
    """attention() with q, k, v (and sinks) requiring grad: the kernels' forward and backward
    against the reference's, through autograd."""
    softcap, with_sinks = VARIANTS[variant]
    gen = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = _data((2, 517, 8, 128), (2, 517, 2, 128), torch.bfloat16, gen)
    sinks = torch.randn(8, generator=gen, device="cuda") if with_sinks else None
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    o = fmha.attention(*leaves[:3], causal=True, softcap=softcap, sinks=leaves[3] if with_sinks else None,
                       backend="kernel")
    o_ref = fmha.attention(*refs[:3], causal=True, softcap=softcap, sinks=refs[3] if with_sinks else None,
                           backend="reference")
    assert rel_l2(o, o_ref) < 1e-2
    dout = torch.randn(o.shape, generator=gen, device="cuda").to(o.dtype)
    o.backward(dout)
    o_ref.backward(dout)
    for a, b in zip(leaves, refs):
        assert rel_l2(a.grad, b.grad) < 2e-2
