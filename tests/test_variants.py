"""The attention variants on the CPU: softcap, sinks, negative window sides, any head dim (V's
unlike Q's too), fp32/fp64 inputs. The reference's forward and backward against the naive fp64
attention of ``tests/naive.py`` (its gradients by autograd), and the public entry points
(autograd, the custom ops, the KV cache) running them through the reference."""

import math

import pytest
import torch

import fmha
from fmha.masking import MaskSpec
from fmha.options import op_args, parse
from fmha.reference import attention_backward_reference, attention_reference

from naive import naive_attention, naive_mask

CASES = [
    # (name, S_q, S_k, H_q, H_k, D, D_v, mask kwargs, softcap, sinks)
    ("softcap", 37, 53, 4, 2, 32, 32, dict(causal=True), 5.0, False),
    ("sinks", 37, 53, 4, 1, 32, 32, dict(), 0.0, True),
    ("sinks causal, empty rows", 41, 23, 2, 2, 16, 16, dict(causal=True), 0.0, True),
    ("softcap + sinks window", 30, 30, 4, 2, 64, 64, dict(window_size=(7, 3)), 2.5, True),
    ("negative right side", 29, 31, 2, 1, 32, 32, dict(window_size=(None, -5)), 0.0, False),
    ("negative left side", 29, 31, 2, 1, 32, 32, dict(window_size=(-3, 9), mask_align="bottom_right"), 0.0, False),
    ("causal clips right", 29, 31, 2, 2, 32, 32, dict(causal=True, window_size=(6, 4)), 0.0, True),
    ("empty band", 17, 19, 2, 2, 16, 16, dict(window_size=(-4, -6)), 0.0, True),
    ("D=96", 21, 33, 2, 1, 96, 96, dict(causal=True), 0.0, False),
    ("192/128", 21, 33, 4, 2, 192, 128, dict(), 0.0, True),
    ("36/20", 13, 15, 2, 2, 36, 20, dict(causal=True), 3.0, False),
]


def _inputs(sq, sk, hq, hk, d, dv, dtype, seed, batch=2, sinks=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, hq, d, generator=g).to(dtype)
    k = torch.randn(batch, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(batch, sk, hk, dv, generator=g).to(dtype)
    s = (torch.randn(hq, generator=g) * 2).to(torch.float64 if dtype == torch.float64 else torch.float32) \
        if sinks else None
    return q, k, v, s


def _close(got, want, tol):
    err = (got.double() - want.double()).norm() / max(want.double().norm(), 1e-30)
    assert err < tol, f"relative L2 error {err:.3g}"


def _lse_close(got, want):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    fin = torch.isfinite(want)
    if fin.any():
        assert (got[fin].double() - want[fin].double()).abs().max() < 1e-9


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_reference_forward_and_backward_against_naive(case):
    name, sq, sk, hq, hk, d, dv, mask_kw, softcap, with_sinks = case
    q, k, v, sinks = _inputs(sq, sk, hq, hk, d, dv, torch.float64, seed=len(name), sinks=with_sinks)
    mask = MaskSpec.from_args(**mask_kw)
    o, lse = attention_reference(q, k, v, mask=mask, softcap=softcap, sinks=sinks, compute_dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if with_sinks else [])
    qn, kn, vn = leaves[:3]
    sn = leaves[3] if with_sinks else None
    o_n, lse_n = naive_attention(qn, kn, vn, naive_mask(**mask_kw), softcap=softcap, sinks=sn)
    _close(o, o_n.detach(), 1e-12)
    _lse_close(lse, lse_n.detach())
    if with_sinks:  # a row with no key: O = 0 and LSE = the sink
        assert torch.isfinite(lse).all()

    g = torch.Generator().manual_seed(7)
    dout = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    fin = torch.isfinite(lse_n)
    loss = (o_n * dout).sum() + (torch.where(fin, lse_n, torch.zeros_like(lse_n)) * dlse).sum()
    want = [torch.zeros_like(t) if g is None else g for t, g in
            zip(leaves, torch.autograd.grad(loss, leaves, allow_unused=True))]
    got = attention_backward_reference(dout, q, k, v, o, lse, mask=mask, softcap=softcap, sinks=sinks, dlse=dlse,
                                       compute_dtype=torch.float64)
    assert len(got) == len(want)
    for gname, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        _close(a, b, 1e-10)


def test_softcap_bounds_the_scores():
    """With a tiny softcap every score is within (-c, c): the softmax is almost uniform."""
    q, k, v, _ = _inputs(8, 64, 1, 1, 32, 32, torch.float64, seed=3, batch=1)
    o, lse = attention_reference(q * 100, k, v, softcap=1e-3, compute_dtype=torch.float64)
    _close(o, v.mean(dim=1, keepdim=True).expand_as(o), 1e-2)
    assert (lse - math.log(64)).abs().max() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("varlen", [False, True])
def test_attention_autograd_with_variants(dtype, varlen):
    """fmha.attention / attention_varlen on the CPU: O, LSE and every gradient (the sinks' too)
    equal the naive fp64 attention's, through the eager autograd path and the custom ops."""
    hq, hk, d, dv = 4, 2, 48, 32
    lens_q, lens_k = [5, 0, 1, 17], [9, 3, 0, 17]
    g = torch.Generator().manual_seed(11)
    if varlen:
        q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
        k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
        v = torch.randn(sum(lens_k), hk, dv, generator=g).to(dtype)
    else:
        q = torch.randn(2, 19, hq, d, generator=g).to(dtype)
        k = torch.randn(2, 23, hk, d, generator=g).to(dtype)
        v = torch.randn(2, 23, hk, dv, generator=g).to(dtype)
    sinks = torch.randn(hq, generator=g).to(torch.float64 if dtype == torch.float64 else torch.float32)
    kw = dict(causal=True, window_size=(8, -1), softcap=4.0, mask_align="bottom_right")
    cu = [torch.tensor([0] + [sum(ls[:i + 1]) for i in range(len(ls))], dtype=torch.int32) for ls in (lens_q, lens_k)]

    def call(fn, *t, **extra):
        if varlen:
            return fn(*t[:3], cu[0], cu[1], sinks=t[3], return_lse=True, **kw, **extra)
        return fn(*t[:3], sinks=t[3], return_lse=True, **kw, **extra)

    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    fn = fmha.attention_varlen if varlen else fmha.attention
    o, lse = call(fn, *leaves)
    assert o.dtype == dtype and o.shape[-1] == dv
    naive_leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    extra = dict(cu_q=[int(x) for x in cu[0]], cu_k=[int(x) for x in cu[1]]) if varlen else {}
    o_n, lse_n = naive_attention(*naive_leaves[:3], naive_mask(causal=True, window_size=(8, -1),
                                                              mask_align="bottom_right"),
                                 softcap=4.0, sinks=naive_leaves[3], **extra)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    _close(o, o_n.detach(), tol)
    dout = torch.randn(o.shape, generator=g).to(dtype)
    o.backward(dout)
    (o_n * dout.double()).sum().backward()
    for a, b in zip(leaves, naive_leaves):
        _close(a.grad, b.grad, 4 * tol)
    # the same through the custom ops (what torch.compile traces)
    leaves2 = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    options = op_args(parse(causal=True, window_size=(8, -1), mask_align="bottom_right",
                            softmax_scale=1 / math.sqrt(d), softcap=4.0))
    if varlen:
        o2, lse2 = torch.ops.fmha.attention_forward(
            *leaves2, [], None, None, cu[0], cu[1], True, None, None, *options, None, "auto", None, None, False)
    else:
        o2, lse2 = torch.ops.fmha.attention_forward(
            *leaves2, [], None, None, None, None, False, None, None, *options, None, "auto", None, None, False)
    assert torch.equal(o2, o.detach())
    o2.backward(dout)
    for a, b in zip(leaves2, leaves):
        assert torch.equal(a.grad, b.grad)


def test_attention_backward_returns_dsinks():
    q, k, v, sinks = _inputs(19, 21, 4, 2, 64, 64, torch.bfloat16, seed=5, sinks=True)
    o, lse = fmha.attention(q, k, v, sinks=sinks, causal=True, return_lse=True)
    dout = torch.randn_like(o)
    grads = fmha.attention_backward(dout, q, k, v, o, lse, sinks=sinks, causal=True)
    assert len(grads) == 4 and grads[3].shape == sinks.shape and grads[3].dtype == sinks.dtype
    dsinks = torch.full_like(sinks, math.nan)
    grads2 = fmha.attention_backward(dout, q, k, v, o, lse, sinks=sinks, causal=True, dsinks=dsinks)
    assert grads2[3] is dsinks and torch.equal(dsinks, grads[3])
    with pytest.raises(ValueError, match="dsinks= is the gradient of sinks"):
        fmha.attention_backward(dout, q, k, v, o, lse, causal=True, dsinks=dsinks)


def test_kvcache_with_softcap_and_sinks():
    g = torch.Generator().manual_seed(2)
    b, hq, hk, d, page, pages = 3, 4, 2, 32, 16, 4
    k_cache = torch.randn(b * pages, page, hk, d, generator=g).to(torch.bfloat16)
    v_cache = torch.randn(b * pages, page, hk, d, generator=g).to(torch.bfloat16)
    table = torch.randperm(b * pages, generator=g).to(torch.int32).view(b, pages)
    lengths = torch.tensor([0, 17, 64], dtype=torch.int32)
    q = torch.randn(b, 2, hq, d, generator=g).to(torch.bfloat16)
    sinks = torch.randn(hq, generator=g)
    o, lse = fmha.attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table, softcap=3.0, sinks=sinks,
                                         return_lse=True)
    for i in range(b):
        n = int(lengths[i])
        rows = table[i].long().repeat_interleave(page)[:n]
        cols = torch.arange(n) % page
        k, v = k_cache[rows, cols][None], v_cache[rows, cols][None]
        o_n, lse_n = naive_attention(q[i:i + 1], k, v, naive_mask(causal=True, mask_align="bottom_right"),
                                     softcap=3.0, sinks=sinks)
        _close(o[i:i + 1], o_n, 1e-2)
        _lse_close(lse[i:i + 1].double(), lse_n) if n == 0 else None
        assert (lse[i:i + 1].double() - lse_n).abs().max() < 1e-4
