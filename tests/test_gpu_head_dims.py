"""The Hopper forward at head dims beyond 32/64/128/256 and with V's head dim unlike Q's
(DeepSeek's 192/128, 128/64, ...), through the public API with ``backend="kernel"`` (no
fallback), against the fp64 reference: every mask kind, dense and varlen (empty and length-1
sequences), GQA, with softcap and sinks too; the backward at the new head dims it serves
(multiples of 32: 96, 160, 192, 224, and V's unlike Q's: 192/128, 128/64, ...), deterministic
too, and through autograd; decode over dense and paged caches at the new head dims. Outputs and
gradients are poisoned with
NaN first, so unwritten elements show. Marked ``gpu``; skipped without a Hopper GPU."""

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
}
#: (Q/K head dim, V head dim): the new equal dims, then unequal pairs
DIMS = [(16, 16), (48, 48), (80, 80), (96, 96), (112, 112), (160, 160), (192, 192), (224, 224),
        (192, 128), (128, 64), (64, 128), (256, 128), (128, 256), (96, 64)]


FORWARD = [(torch.bfloat16, d, dv, m, layout, "plain") for d, dv in DIMS for m in MASKS for layout in ("dense", "varlen")]
FORWARD += [(torch.float16, d, dv, "causal", "dense", "plain") for d, dv in ((96, 96), (192, 128), (192, 192))]
FORWARD += [(torch.bfloat16, d, dv, "causal", layout, var) for d, dv in ((96, 96), (192, 128), (192, 192))
            for layout in ("dense", "varlen") for var in ("softcap", "sinks")]


@_needs_hopper
@pytest.mark.parametrize("dtype,d,dv,mask,layout,variant", FORWARD,
                         ids=[f"{str(a).split('.')[-1]}-D{b}-Dv{c}-{m}-{l}-{v}" for a, b, c, m, l, v in FORWARD])
def test_forward(dtype, d, dv, mask, layout, variant):
    gen = torch.Generator(device="cuda").manual_seed(d * 7 + dv + len(mask) + len(layout))
    softcap = 6.0 if variant == "softcap" else 0.0
    sinks = torch.randn(8, generator=gen, device="cuda") * 2 if variant == "sinks" else None
    kw = dict(MASKS[mask], softcap=softcap, sinks=sinks)
    if layout == "dense":
        shape_q, shape_k, shape_v = (2, 333, 8, d), (2, 301, 2, d), (2, 301, 2, dv)
    else:
        lens_q, lens_k = [0, 1, 200, 77, 1], [5, 1, 260, 0, 300]
        shape_q, shape_k, shape_v = (sum(lens_q), 8, d), (sum(lens_k), 2, d), (sum(lens_k), 2, dv)
    q = torch.randn(shape_q, generator=gen, device="cuda").to(dtype)
    k = torch.randn(shape_k, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape_v, generator=gen, device="cuda").to(dtype)
    out = torch.full(shape_q[:-1] + (dv,), math.nan, dtype=dtype, device="cuda")
    if layout == "dense":
        cu_q = cu_k = None
        lse = torch.full((2, 8, 333), math.nan, device="cuda")
        fmha.attention(q, k, v, out=out, lse=lse, backend="kernel", **kw)
    else:
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        lse = torch.full((8, sum(lens_q)), math.nan, device="cuda")
        fmha.attention_varlen(q, k, v, cu_q, cu_k, out=out, lse=lse, backend="kernel", **kw)
    want_o, want_lse = attention_reference(q, k, v, cu_q, cu_k, mask=MaskSpec.from_args(**MASKS[mask]),
                                           softcap=softcap, sinks=sinks, compute_dtype=torch.float64)
    assert rel_l2(out, want_o) < 1e-2
    assert lse_max_err(lse, want_lse) < 5e-3


#: (D, D_v, page size (0: dense cache), splits, S_q): decode over a KV cache at the new head dims
DECODE = [(d, dv, page, splits, s_q) for d, dv in ((96, 96), (192, 128), (128, 64), (80, 80), (192, 192))
          for page, splits in ((0, 1), (64, 3), (32, 1)) for s_q in (1, 5)]


@_needs_hopper
@pytest.mark.parametrize("d,dv,page,splits,s_q", DECODE,
                         ids=[f"D{a}-Dv{b}-page{c}-splits{e}-sq{f}" for a, b, c, e, f in DECODE])
def test_decode(d, dv, page, splits, s_q):
    """attention_with_kvcache (bottom-right causal, GQA packed) at head dims the decode tile was
    not first built for, dense and paged in shuffled pages, with and without split-KV."""
    gen = torch.Generator(device="cuda").manual_seed(d + dv + page + splits + s_q)
    b, hq, hk, cap = 3, 8, 2, 640
    q = torch.randn(b, s_q, hq, d, generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn(b, cap, hk, d, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(b, cap, hk, dv, generator=gen, device="cuda").to(torch.bfloat16)
    lengths = torch.tensor([0, 130, 617], dtype=torch.int32, device="cuda")
    table, k_cache, v_cache = None, k, v
    if page:
        n = cap // page
        perm = torch.randperm(b * n, generator=torch.Generator().manual_seed(1)).to("cuda")
        table = perm.view(b, n).to(torch.int32)
        k_cache = torch.empty(b * n, page, hk, d, dtype=k.dtype, device="cuda")
        v_cache = torch.empty(b * n, page, hk, dv, dtype=v.dtype, device="cuda")
        k_cache[perm] = k.view(b * n, page, hk, d)
        v_cache[perm] = v.view(b * n, page, hk, dv)
    out = torch.full((b, s_q, hq, dv), math.nan, dtype=q.dtype, device="cuda")
    lse = torch.full((b, hq, s_q), math.nan, device="cuda")
    fmha.attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table, out=out, lse=lse,
                                backend="kernel", num_splits=splits, causal=True)
    mspec = MaskSpec.from_args(causal=True, mask_align="bottom_right")
    for i in range(b):
        n = int(lengths[i])
        wo, wl = attention_reference(q[i:i + 1], k[i:i + 1, :n], v[i:i + 1, :n], mask=mspec,
                                     compute_dtype=torch.float64)
        assert rel_l2(out[i:i + 1], wo) < 1e-2
        assert lse_max_err(lse[i:i + 1], wl) < 5e-3


BACKWARD = [(torch.bfloat16, d, d, m, layout, "plain", False) for d in (96, 160, 192, 224) for m in MASKS
            for layout in ("dense", "varlen")]
BACKWARD += [(torch.bfloat16, d, dv, m, layout, "plain", False) for d, dv in ((192, 128), (128, 64), (64, 128),
                                                                             (256, 128), (96, 64))
             for m in ("none", "causal", "neg_right_br") for layout in ("dense", "varlen")]
BACKWARD += [(torch.float16, d, dv, "causal", "dense", "plain", False) for d, dv in ((96, 96), (192, 192), (192, 128))]
BACKWARD += [(torch.bfloat16, d, dv, "causal", layout, "plain", True) for d, dv in ((96, 96), (192, 192), (192, 128))
             for layout in ("dense", "varlen")]
BACKWARD += [(torch.bfloat16, d, dv, "window", "dense", var, False) for d, dv in ((96, 96), (192, 192), (192, 128))
             for var in ("softcap", "sinks")]


@_needs_hopper
@pytest.mark.parametrize("dtype,d,dv,mask,layout,variant,det", BACKWARD,
                         ids=[f"{str(a).split('.')[-1]}-D{b}-Dv{c}-{m}-{l}-{v}{'-det' if t else ''}"
                              for a, b, c, m, l, v, t in BACKWARD])
def test_backward(dtype, d, dv, mask, layout, variant, det):
    gen = torch.Generator(device="cuda").manual_seed(5 * d + dv + len(mask) + len(layout))
    softcap = 6.0 if variant == "softcap" else 0.0
    sinks = torch.randn(4, generator=gen, device="cuda") * 2 if variant == "sinks" else None
    mspec = MaskSpec.from_args(**MASKS[mask])
    if layout == "dense":
        shape_q, shape_k = (2, 257, 4, d), (2, 299, 2, d)
        cu_q = cu_k = None
    else:
        lens_q, lens_k = [0, 1, 190, 65], [4, 1, 0, 200]
        shape_q, shape_k = (sum(lens_q), 4, d), (sum(lens_k), 2, d)
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = torch.randn(shape_q, generator=gen, device="cuda").to(dtype)
    k = torch.randn(shape_k, generator=gen, device="cuda").to(dtype)
    v = torch.randn(shape_k[:-1] + (dv,), generator=gen, device="cuda").to(dtype)
    o, lse = attention_reference(q, k, v, cu_q, cu_k, mask=mspec, softcap=softcap, sinks=sinks)
    out = o.to(dtype)
    dout = torch.randn(out.shape, generator=gen, device="cuda").to(dtype)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    dsinks = torch.full_like(sinks, math.nan) if sinks is not None else None
    kw = dict(MASKS[mask], softcap=softcap, sinks=sinks, deterministic=det, backend="kernel")
    cu = (cu_q, cu_k) if layout == "varlen" else ()
    got = fmha.attention_backward(dout, q, k, v, out, lse, *cu, dq=grads[0], dk=grads[1], dv=grads[2],
                                  dsinks=dsinks, **kw)
    want = attention_backward_reference(dout, q, k, v, out, lse, cu_q, cu_k, mask=mspec, softcap=softcap,
                                        sinks=sinks, compute_dtype=torch.float64)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        tol = 3e-2 if name == "dsinks" else 2e-2
        assert rel_l2(g, w) < tol, f"{name}: {rel_l2(g, w):.3g}"
    if det:
        again = fmha.attention_backward(dout, q, k, v, out, lse, *cu, **kw)
        for g, h in zip(got, again):
            assert torch.equal(g, h)


@_needs_hopper
@pytest.mark.parametrize("d,dv", [(192, 128), (96, 96), (192, 192)])
def test_autograd(d, dv):
    """The kernels' forward and backward under autograd: the gradients match the fp64
    reference's."""
    gen = torch.Generator(device="cuda").manual_seed(d + dv)
    q = torch.randn(2, 130, 4, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    k = torch.randn(2, 170, 2, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    v = torch.randn(2, 170, 2, dv, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    do = torch.randn(2, 130, 4, dv, generator=gen, device="cuda").to(torch.bfloat16)
    out = fmha.attention(q, k, v, causal=True, backend="kernel")
    out.backward(do)
    mask = MaskSpec.from_args(causal=True)
    q0, k0, v0 = (t.detach() for t in (q, k, v))
    want, lse = attention_reference(q0, k0, v0, mask=mask, compute_dtype=torch.float64)
    wants = attention_backward_reference(do, q0, k0, v0, want, lse, mask=mask, compute_dtype=torch.float64)
    assert rel_l2(out, want) < 1e-2
    for got, ref in zip((q.grad, k.grad, v.grad), wants):
        assert rel_l2(got, ref) < 2e-2
