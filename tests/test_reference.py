"""fmha.reference against the naive fp64 attention (tests/naive.py) and PyTorch SDPA."""

import math

import pytest
import torch
import torch.nn.functional as F

from fmha.masking import MaskSpec
from fmha.reference import _chunk_sizes, attention_reference, cast_output
from naive import naive_attention, naive_mask

MASKS = [
    dict(),
    dict(causal=True),
    dict(causal=True, mask_align="bottom_right"),
    *[dict(window_size=w, mask_align=a)
      for w in [(0, 0), (64, 0), (None, 0), (100, 37), (0, None), (3, 5)]
      for a in ("top_left", "bottom_right")],
]
MASK_IDS = [",".join(f"{k}={v}" for k, v in m.items()) or "none" for m in MASKS]


def rand(*shape, dtype=torch.float16, gen=None):
    x = torch.randn(*shape, generator=gen)
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-4, 4)
    return x.to(dtype)


def qkv(b, sq, sk, hq, hk, d, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (rand(b, sq, hq, d, dtype=dtype, gen=g), rand(b, sk, hk, d, dtype=dtype, gen=g),
            rand(b, sk, hk, d, dtype=dtype, gen=g))


def reference(q, k, v, cu_q=None, cu_k=None, mask_args=None, **kw):
    return attention_reference(q, k, v, cu_q, cu_k, mask=MaskSpec.from_args(**(mask_args or {})),
                               **kw)


def assert_matches_naive(q, k, v, mask_args, cu_q=None, cu_k=None, atol=2e-5, **kw):
    o, lse = reference(q, k, v, cu_q, cu_k, mask_args, **kw)
    kw.pop("compute_dtype", None)
    lists = (None, None) if cu_q is None else (cu_q.tolist(), cu_k.tolist())
    o_n, lse_n = naive_attention(q, k, v, naive_mask(**mask_args), *lists, **kw)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(o.double(), o_n, atol=atol, rtol=atol)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_n))
    fin = torch.isfinite(lse_n)
    torch.testing.assert_close(lse.double()[fin], lse_n[fin], atol=atol, rtol=atol)
    return o, lse


@pytest.mark.parametrize("mask_args", MASKS, ids=MASK_IDS)
@pytest.mark.parametrize("sq,sk", [(77, 130), (130, 77), (1, 1), (65, 65)])
def test_masks_and_lengths(mask_args, sq, sk):
    q, k, v = qkv(2, sq, sk, 2, 1, 32)
    assert_matches_naive(q, k, v, mask_args)


@pytest.mark.parametrize("sq,sk", [(130, 33), (64, 64), (100, 7), (5, 2)])
def test_compressed_causal(sq, sk):
    q, k, v = qkv(2, sq, sk, 2, 2, 32)
    o, lse = assert_matches_naive(q, k, v, dict(compressed_causal=True))
    c = sq // sk
    # rows i < c - 1 keep nothing
    assert torch.isneginf(lse[:, :, : c - 1]).all() and (o[:, : c - 1] == 0).all()


@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 2), (8, 2), (4, 1)],
                         ids=["MHA", "GQA2", "GQA4", "MQA"])
def test_gqa(hq, hk):
    q, k, v = qkv(2, 40, 50, hq, hk, 64, dtype=torch.bfloat16)
    assert_matches_naive(q, k, v, dict(causal=True))


def cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("mask_args", [dict(), dict(causal=True),
                                       dict(window_size=(3, 0), mask_align="bottom_right"),
                                       dict(window_size=(None, 2), mask_align="bottom_right")],
                         ids=["none", "causal", "window_br", "right_br"])
def test_varlen(mask_args):
    lens_q, lens_k = [0, 1, 37, 5, 0, 20], [3, 1, 20, 0, 0, 41]
    g = torch.Generator().manual_seed(1)
    q = rand(sum(lens_q), 4, 32, gen=g)
    k, v = rand(sum(lens_k), 2, 32, gen=g), rand(sum(lens_k), 2, 32, gen=g)
    o, lse = assert_matches_naive(q, k, v, mask_args, cu(lens_q), cu(lens_k))
    assert o.shape == (sum(lens_q), 4, 32) and lse.shape == (4, sum(lens_q))
    # sequence 3 has keys 0: its five rows keep nothing
    rows = slice(38, 43)
    assert (o[rows] == 0).all() and torch.isneginf(lse[:, rows]).all()


def test_varlen_compressed_causal():
    lens_q, lens_k = [0, 1, 40, 9], [0, 1, 10, 4]
    g = torch.Generator().manual_seed(2)
    q = rand(sum(lens_q), 2, 32, gen=g)
    k, v = rand(sum(lens_k), 2, 32, gen=g), rand(sum(lens_k), 2, 32, gen=g)
    assert_matches_naive(q, k, v, dict(compressed_causal=True), cu(lens_q), cu(lens_k))


def test_scales():
    q, k, v = qkv(1, 33, 45, 2, 1, 64)
    assert_matches_naive(q, k, v, dict(causal=True), softmax_scale=0.3, scale_q=1.5,
                         scale_k=0.25, scale_v=2.0, inv_scale_o=0.5)


def test_default_softmax_scale_is_inverse_sqrt_d():
    q, k, v = qkv(1, 20, 20, 1, 1, 128)
    o_default, _ = reference(q, k, v)
    o_explicit, _ = reference(q, k, v, softmax_scale=1 / math.sqrt(128))
    o_other, _ = reference(q, k, v, softmax_scale=1.0)
    assert torch.equal(o_default, o_explicit) and not torch.allclose(o_default, o_other)


def test_fp8_rounds_p():
    q, k, v = qkv(1, 50, 70, 2, 2, 64, dtype=torch.float8_e4m3fn)
    kw = dict(scale_q=0.5, scale_k=2.0, scale_v=0.7, compute_dtype=torch.float64)
    o, _ = assert_matches_naive(q, k, v, dict(causal=True), atol=1e-9, **kw)
    kw.pop("compute_dtype")
    o_exact_p, _ = naive_attention(q, k, v, naive_mask(causal=True), round_p_fp8=False, **kw)
    # the rounding is visible: a reference without it would not pass the check above
    assert (o - o_exact_p).abs().max() > 1e-3


def test_fully_masked_rows_give_zero_and_neg_inf():
    # bottom-right causal with S_q > S_k: the first S_q - S_k rows keep nothing
    q, k, v = qkv(1, 50, 20, 2, 2, 32)
    o, lse = reference(q, k, v, mask_args=dict(causal=True, mask_align="bottom_right"))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert (o[:, :30] == 0).all() and torch.isneginf(lse[:, :, :30]).all()
    assert torch.isfinite(lse[:, :, 30:]).all()


def test_no_keys_at_all():
    q = rand(2, 5, 2, 32)
    k = v = rand(2, 0, 2, 32)
    o, lse = reference(q, k, v)
    assert (o == 0).all() and torch.isneginf(lse).all()


def test_compute_dtype_and_shapes():
    q, k, v = qkv(2, 9, 11, 4, 2, 32)
    o, lse = reference(q, k, v, compute_dtype=torch.float64)
    assert o.dtype == lse.dtype == torch.float64
    assert o.shape == (2, 9, 4, 32) and lse.shape == (2, 4, 9)


def test_bhsd_view_equals_bshd():
    q, k, v = qkv(2, 30, 40, 4, 2, 32)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert views[0].stride() != q.stride()
    for a, b in zip(reference(*views, mask_args=dict(causal=True)),
                    reference(q, k, v, mask_args=dict(causal=True))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("budget", [1, 3 * 40 * 4, 2 * 30 * 40 * 4], ids=["row", "rows", "heads"])
@pytest.mark.parametrize("mask_args", [dict(), dict(window_size=(5, 3))], ids=["none", "window"])
def test_chunking_matches_unchunked(budget, mask_args):
    q, k, v = qkv(2, 30, 40, 4, 2, 32)
    whole = reference(q, k, v, mask_args=mask_args)
    chunked = reference(q, k, v, mask_args=mask_args, chunk_bytes=budget)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("sq,sk,heads",
                         [(16384, 16384, 8), (100, 7, 3), (5000, 1, 64), (1, 10**7, 2)])
def test_chunk_sizes_respect_budget(sq, sk, heads):
    budget = 256 << 20
    rows, hs = _chunk_sizes(sq, sk, heads, 4, budget)
    assert 1 <= rows <= max(sq, 1) and 1 <= hs <= heads
    assert rows * hs * sk * 4 <= budget or (rows == 1 and hs == 1)
    # and it does not chunk needlessly
    if sq * heads * sk * 4 <= budget:
        assert (rows, hs) == (sq, heads)


def test_cast_output_saturates_fp8():
    x = torch.tensor([1.0, 1000.0, -1e6, 0.0])
    assert cast_output(x, torch.float8_e4m3fn).float().tolist() == [1.0, 448.0, -448.0, 0.0]


# --- against torch SDPA, where it can express the mask -------------------------------------

def sdpa(q, k, v, attn_mask=None, is_causal=False):
    """BSHD in, BSHD out, fp64, GQA by repeating K/V heads."""
    group = q.shape[2] // k.shape[2]
    qt, kt, vt = (x.double().transpose(1, 2) for x in (q, k, v))
    kt, vt = kt.repeat_interleave(group, dim=1), vt.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask,
                                          is_causal=is_causal).transpose(1, 2)


def band_mask(sq, sk, left, right, bottom_right):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    off = sk - sq if bottom_right else 0
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        keep &= j >= i + off - left
    if right is not None:
        keep &= j <= i + off + right
    return keep


@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 90), (90, 40)])
@pytest.mark.parametrize("hq,hk", [(4, 4), (4, 1)])
def test_sdpa_no_mask_and_causal(sq, sk, hq, hk):
    q, k, v = qkv(2, sq, sk, hq, hk, 64)
    o, _ = reference(q, k, v)
    torch.testing.assert_close(o.double(), sdpa(q, k, v), atol=2e-5, rtol=2e-5)
    o, _ = reference(q, k, v, mask_args=dict(causal=True))  # SDPA's is_causal is top-left
    torch.testing.assert_close(o.double(), sdpa(q, k, v, is_causal=True), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [(None, 0), (16, 0), (7, 9)])
@pytest.mark.parametrize("sq,sk", [(40, 90), (64, 64)])
def test_sdpa_bottom_right_and_windows(window, sq, sk):
    # S_q <= S_k so every row keeps a key: SDPA returns NaN for rows that keep none
    q, k, v = qkv(2, sq, sk, 4, 2, 32)
    o, _ = reference(q, k, v, mask_args=dict(window_size=window, mask_align="bottom_right"))
    want = sdpa(q, k, v, attn_mask=band_mask(sq, sk, *window, True))
    torch.testing.assert_close(o.double(), want, atol=2e-5, rtol=2e-5)
