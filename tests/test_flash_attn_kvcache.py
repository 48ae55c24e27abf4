"""fmha.flash_attn's paged and cached calls on the CPU: ``flash_attn_varlen_func`` over a paged
cache (``page_table`` + ``seqused_k``) and FlashAttention-3's ``flash_attn_with_kvcache`` (dense
and paged caches, new keys, packed queries, fp8 caches' descale tensors, its errors), against the
naive fp64 attention of tests/naive.py."""

import pytest
import torch

import fmha
from fmha.flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from naive import naive_sequence
from test_flash_attn_compat import _pack, _randn, assert_close, fa_mask, naive_dense


# ---------------------------------------------------------------------------------------------
# paged caches through flash_attn_varlen_func (page_table + seqused_k)


def _paged_cache(dense, page_size, seed, spare_pages=3):
    """The dense (B, S, H, D) cache cut into pages in shuffled order, NaN in the spare pages;
    page-table entries past a sequence's pages are -1 (never read)."""
    batch, s = dense.shape[:2]
    per_seq = s // page_size
    num_pages = batch * per_seq + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    cache = torch.full((num_pages, page_size) + dense.shape[2:], float("nan"))
    table = torch.full((batch, per_seq + 1), -1, dtype=torch.int32)
    for b in range(batch):
        for i in range(per_seq):
            page = int(order[b * per_seq + i])
            cache[page] = dense[b, i * page_size:(i + 1) * page_size]
            table[b, i] = page
    return cache, table


@pytest.mark.parametrize("page_size,strided", [(16, False), (4, False), (4, True)])  # strided pages: gathered
@pytest.mark.parametrize("varlen_q", [False, True])
def test_paged_cache(page_size, strided, varlen_q, monkeypatch):
    batch, s_cache = 3, 32
    lens = [32, 1, 17]
    kd, vd = _randn(batch, s_cache, 2, 16, seed=1), _randn(batch, s_cache, 2, 16, seed=2)
    for b in range(batch):  # positions past a sequence's length: never read
        kd[b, lens[b]:] = float("nan")
        vd[b, lens[b]:] = float("nan")
    kc, table = _paged_cache(kd, page_size, seed=3)
    vc, _ = _paged_cache(vd, page_size, seed=3)
    if strided:  # pages that do not follow each other in memory: not fmha's paged cache
        kc, vc = (torch.cat([c, torch.full_like(c, float("nan"))], dim=1)[:, :page_size] for c in (kc, vc))
    sink = _randn(4, seed=4)
    calls = []
    monkeypatch.setattr(fmha, "attention_with_kvcache",
                        lambda *a, _f=fmha.attention_with_kvcache, **kw: calls.append(1) or _f(*a, **kw))
    if varlen_q:
        lq = [3, 0, 2]
        q, cu_q, qs = _pack(lq, 4, 16, seed=0)
        out, lse = flash_attn_varlen_func(q, kc, vc, cu_seqlens_q=cu_q, seqused_k=torch.tensor(lens, dtype=torch.int32),
                                          page_table=table, causal=True, learnable_sink=sink, return_lse=True)
        assert lse.shape == (4, 5)
        for b in range(batch):
            ref_o, ref_l = naive_sequence(qs[b], kd[b, :lens[b]], vd[b, :lens[b]], fa_mask(True), sinks=sink)
            rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
            assert_close(out[rows], ref_o)
            assert_close(lse[:, rows], ref_l)
    else:
        q = _randn(batch, 2, 4, 16, seed=0)
        out, lse = flash_attn_varlen_func(q, kc, vc, seqused_k=torch.tensor(lens, dtype=torch.int32),
                                          page_table=table, causal=True, window_size=(9, None),
                                          learnable_sink=sink, return_lse=True)
        assert lse.shape == (batch, 4, 2)
        for b in range(batch):
            ref_o, ref_l = naive_sequence(q[b], kd[b, :lens[b]], vd[b, :lens[b]], fa_mask(True, (9, None)),
                                          sinks=sink)
            assert_close(out[b], ref_o)
            assert_close(lse[b], ref_l)
    # dense or packed queries over pages fmha's paged cache takes go to fmha.attention_with_kvcache
    assert calls == ([] if strided else [1])


def test_paged_without_seqused_uses_every_page_and_checks_pages():
    q = _randn(2, 3, 2, 16, seed=0)
    kd = _randn(2, 8, 2, 16, seed=1)
    kc, table = _paged_cache(kd, 4, seed=2)
    table = table[:, :2].contiguous()  # exactly the pages each sequence has
    out, _ = flash_attn_varlen_func(q, kc, kc, page_table=table, causal=True)
    ref_o, _ = naive_dense(q, kd, kd, fa_mask(True))
    assert_close(out, ref_o)
    bad = table.clone()
    bad[1, 1] = 99
    with pytest.raises(ValueError, match=r"page_table\[1, 1\] = 99 is not a page"):
        flash_attn_varlen_func(q, kc, kc, page_table=bad, seqused_k=torch.tensor([8, 8], dtype=torch.int32))


def test_errors_name_the_arguments_as_flash_attention_spells_them():
    """fmha.attention_with_kvcache serves these calls; its errors say k/v, page_table, seqused_k
    and k_descale, not its own k_new/v_new, block_table, cache_seqlens and scale_k."""
    q = _randn(3, 4, 64, seed=0)
    kp = _randn(8, 16, 2, 64, seed=1)
    cu = torch.tensor([0, 1, 3], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    with pytest.raises(ValueError, match=r"^seqused_k\[1\] = -1 does not fit .*\(page_table columns"):
        flash_attn_varlen_func(q, kp, kp, cu_seqlens_q=cu, max_seqlen_q=2, page_table=table,
                               seqused_k=torch.tensor([5, -1], dtype=torch.int32))
    qd, cache = _randn(2, 1, 4, 64, seed=2), _randn(2, 32, 2, 64, seed=3)
    new = _randn(2, 1, 2, 32, seed=4)
    with pytest.raises(ValueError, match=r"^k must be \(B, S_new, H_k, D\)"):
        flash_attn_with_kvcache(qd, cache, cache, k=new, v=new, cache_seqlens=4)
    fp8 = cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^k_descale must have shape"):
        flash_attn_with_kvcache(qd.to(torch.bfloat16), fp8, fp8, cache_seqlens=4, k_descale=torch.ones(3, 3))


# ---------------------------------------------------------------------------------------------
# flash_attn_with_kvcache (FlashAttention-3's signature)


def _kvcache_case(batch=3, s_cache=32, seed=0):
    k = _randn(batch, s_cache, 2, 16, seed=seed + 1)
    v = _randn(batch, s_cache, 2, 16, seed=seed + 2)
    return k, v


@pytest.mark.parametrize("page_size", [None, 16, 4])
@pytest.mark.parametrize("new_kv", [False, True])
def test_kvcache_dense_and_paged(page_size, new_kv):
    batch, s_new = 3, 2
    lens = [5, 0, 30]
    kd, vd = _kvcache_case()
    q = _randn(batch, 3, 4, 16, seed=7)
    kn, vn = _randn(batch, s_new, 2, 16, seed=8), _randn(batch, s_new, 2, 16, seed=9)
    expected_k, expected_v = kd.clone(), vd.clone()
    if new_kv:
        for b in range(batch):
            expected_k[b, lens[b]:lens[b] + s_new] = kn[b]
            expected_v[b, lens[b]:lens[b] + s_new] = vn[b]
    used = [n + (s_new if new_kv else 0) for n in lens]
    for b in range(batch):  # rows past what a sequence uses after the append: never read
        kd[b, used[b]:] = float("nan")
        vd[b, used[b]:] = float("nan")
    if page_size is None:
        kc, vc, table = kd.clone(), vd.clone(), None
    else:
        kc, table = _paged_cache(kd, page_size, seed=5)
        vc, _ = _paged_cache(vd, page_size, seed=5)
    cache_seqlens = torch.tensor(lens, dtype=torch.int32)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k=kn if new_kv else None, v=vn if new_kv else None,
                                       cache_seqlens=cache_seqlens, page_table=table, causal=True,
                                       return_softmax_lse=True)
    assert cache_seqlens.tolist() == lens  # not advanced, as in FlashAttention
    assert lse.shape == (batch, 4, 3)
    for b in range(batch):
        ref_o, ref_l = naive_sequence(q[b], expected_k[b, :used[b]], expected_v[b, :used[b]], fa_mask(True))
        assert_close(out[b], ref_o)
        assert_close(lse[b], ref_l)
    if new_kv:  # the new keys landed in the caller's cache
        for b in range(batch):
            for p in range(lens[b], used[b]):
                if page_size is None:
                    got_k, got_v = kc[b, p], vc[b, p]
                else:
                    page = int(table[b, p // page_size])
                    got_k, got_v = kc[page, p % page_size], vc[page, p % page_size]
                assert torch.equal(got_k, expected_k[b, p]) and torch.equal(got_v, expected_v[b, p])


def test_kvcache_defaults_int_seqlens_and_windows():
    kd, vd = _kvcache_case()
    q = _randn(3, 2, 4, 16, seed=3)
    out = flash_attn_with_kvcache(q, kd, vd)  # whole cache, no mask, out only
    ref_o, _ = naive_dense(q, kd, vd, {"kind": "none"})
    assert_close(out, ref_o)
    out = flash_attn_with_kvcache(q, kd, vd, cache_seqlens=20, causal=True, window_size=(4, -1))
    ref_o, _ = naive_dense(q, kd[:, :20], vd[:, :20], {"kind": "window", "left": 4, "right": 0, "bottom_right": True})
    assert_close(out, ref_o)
    # FlashAttention-3: a negative side is unbounded on that side only
    out = flash_attn_with_kvcache(q, kd, vd, cache_seqlens=20, window_size=(-1, 3))
    ref_o, _ = naive_dense(q, kd[:, :20], vd[:, :20],
                           {"kind": "window", "left": None, "right": 3, "bottom_right": True})
    assert_close(out, ref_o)


def test_kvcache_varlen_queries_and_new_keys():
    """Packed queries with packed new keys (cu_seqlens_q, cu_seqlens_k_new) over a paged cache."""
    batch = 3
    lens, lq, lnew = [4, 0, 9], [2, 1, 3], [1, 0, 3]
    kd, vd = _kvcache_case()
    kc, table = _paged_cache(kd, 16, seed=5)
    vc, _ = _paged_cache(vd, 16, seed=5)
    q, cu_q, qs = _pack(lq, 4, 16, seed=6)
    kn, cu_new, kns = _pack(lnew, 2, 16, seed=7)
    vn, _, vns = _pack(lnew, 2, 16, seed=8)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k=kn, v=vn, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       page_table=table, cu_seqlens_q=cu_q, cu_seqlens_k_new=cu_new,
                                       max_seqlen_q=3, causal=True, return_softmax_lse=True)
    assert out.shape == (6, 4, 16) and lse.shape == (4, 6)
    for b in range(batch):
        keys = torch.cat([kd[b, :lens[b]], kns[b]])
        values = torch.cat([vd[b, :lens[b]], vns[b]])
        ref_o, ref_l = naive_sequence(qs[b], keys, values, fa_mask(True))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert_close(out[rows], ref_o)
        assert_close(lse[:, rows], ref_l)


def test_kvcache_errors():
    kd, vd = _kvcache_case()
    q = _randn(3, 2, 4, 16, seed=3)
    kn = _randn(3, 4, 2, 16, seed=4)
    with pytest.raises(ValueError, match="pass both k and v"):
        flash_attn_with_kvcache(q, kd, vd, k=kn)
    with pytest.raises(ValueError, match="does not fit"):
        flash_attn_with_kvcache(q, kd, vd, k=kn, v=kn, cache_seqlens=30)
    with pytest.raises(ValueError, match="one row per sequence"):
        flash_attn_with_kvcache(q[:2], kd, vd)
    with pytest.raises(TypeError, match="caches' dtype"):  # on the path that appends itself
        flash_attn_with_kvcache(q[:, :1].reshape(3, 4, 16), kd, vd, k=kn.double().reshape(12, 2, 16),
                                v=kn.double().reshape(12, 2, 16), cache_seqlens=1,
                                cu_seqlens_q=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
                                cu_seqlens_k_new=torch.tensor([0, 4, 8, 12], dtype=torch.int32))
    kc, table = _paged_cache(kd, 4, seed=5)
    with pytest.raises(ValueError, match="does not fit"):
        flash_attn_with_kvcache(q, kc, kc, k=kn, v=kn, cache_seqlens=30, page_table=table[:, :-1].contiguous())
    with pytest.raises(ValueError, match=r"page_table\[0, 8\] = -1 is not a page"):  # appended past its pages
        flash_attn_with_kvcache(q, kc, kc, k=kn, v=kn, cache_seqlens=30, page_table=table)


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_with_packed_queries_over_a_cache(paged):
    """FlashAttention-3's ``flash_attn_with_kvcache`` with packed queries (``cu_seqlens_q``), no
    new keys: each sequence's rows attend to its cached keys, bottom-right (a mixed batch)."""
    batch, s_cache = 3, 32
    lens = [32, 1, 17]
    kd, vd = _randn(batch, s_cache, 2, 16, seed=1), _randn(batch, s_cache, 2, 16, seed=2)
    q, cu_q, qs = _pack([3, 0, 20], 4, 16, seed=0)
    k, v, table = kd, vd, None
    if paged:
        k, table = _paged_cache(kd, 16, seed=3)
        v, _ = _paged_cache(vd, 16, seed=3)
    out, lse = flash_attn_with_kvcache(q, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                       page_table=table, cu_seqlens_q=cu_q, causal=True, return_softmax_lse=True)
    assert out.shape == q.shape and lse.shape == (4, q.shape[0])
    for b in range(batch):
        ref_o, ref_l = naive_sequence(qs[b], kd[b, :lens[b]], vd[b, :lens[b]], fa_mask(True))
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert_close(out[rows], ref_o)
        assert_close(lse[:, rows], ref_l)


def test_kvcache_takes_an_fp8_caches_descale_tensors():
    """FlashAttention-3's k_descale/v_descale ((B, H_k) float32) are an fp8 cache's dequantization
    factors under a bf16 q: the answer is fmha.attention_with_kvcache's with them as
    scale_k/scale_v. With packed queries, or for a 16-bit cache, they are refused."""
    g = torch.Generator().manual_seed(3)
    b, s_k, hq, hk, d = 2, 40, 4, 2, 32
    q = torch.randn(b, 1, hq, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, s_k, hk, d, generator=g)
    v = torch.randn(b, s_k, hk, d, generator=g)
    k_descale, v_descale = torch.rand(b, hk, generator=g) + 0.1, torch.rand(b, hk, generator=g) + 0.1
    k8 = (k / k_descale[:, None, :, None]).to(torch.float8_e4m3fn)
    v8 = (v / v_descale[:, None, :, None]).to(torch.float8_e4m3fn)
    lens = torch.tensor([7, 40], dtype=torch.int32)
    got = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=k_descale, v_descale=v_descale,
                                  causal=True)
    want = fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=k_descale, scale_v=v_descale)
    assert torch.equal(got, want)
    only_k = flash_attn_with_kvcache(q, k8, v8, cache_seqlens=lens, k_descale=k_descale, causal=True)
    assert torch.equal(only_k, fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=k_descale,
                                                           scale_v=torch.ones(())))
    with pytest.raises(NotImplementedError, match="does not support k_descale"):
        flash_attn_with_kvcache(q, k.to(torch.bfloat16), v.to(torch.bfloat16), cache_seqlens=lens,
                                k_descale=k_descale)
    with pytest.raises(NotImplementedError, match="does not support k_descale"):
        flash_attn_with_kvcache(q[:, 0], k8, v8, cache_seqlens=lens, cu_seqlens_q=torch.tensor([0, 1, 2], dtype=torch.int32),
                                max_seqlen_q=1, k_descale=k_descale)
