"""attention_with_kvcache (the reference path, on the CPU): a paged cache with pages in any order
gives what the dense cache gives, both match the naive fp64 attention over each sequence's keys
(bottom-right masks), appended keys land in the cache where the sequence continues, and bad
caches and block tables get errors that say what to change."""

import math

import pytest
import torch

import fmha
from naive import naive_sequence

B, HQ, HK, D = 4, 4, 2, 32
DT = torch.bfloat16
TOL = 2e-2  # bf16 outputs
LENS = [0, 1, 37, 100]


def _dense(max_len=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, max_len, HK, D, generator=g).to(DT)
    v = torch.randn(B, max_len, HK, D, generator=g).to(DT)
    return k, v


def _paged(k, v, page_size, seed=1):
    """The dense cache's rows in pages of ``page_size``, the pages shuffled; unused block-table
    entries are -1 (never read)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = k.shape[1] // page_size
    order = torch.randperm(B * per_seq, generator=g)
    kp = torch.empty(B * per_seq + 3, page_size, HK, D, dtype=DT)
    vp = torch.empty_like(kp)
    table = torch.full((B, per_seq + 2), -1, dtype=torch.int32)
    for b in range(B):
        for i in range(per_seq):
            page = int(order[b * per_seq + i])
            kp[page] = k[b, i * page_size:(i + 1) * page_size]
            vp[page] = v[b, i * page_size:(i + 1) * page_size]
            if i * page_size < LENS[b] + 8:
                table[b, i] = page
    return kp, vp, table


def _want(q, k, v, lens, mask):
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((B, HQ, q.shape[1]), -math.inf, dtype=torch.float64)
    for b, n in enumerate(lens):
        o, l = naive_sequence(q[b].double(), k[b, :n].double(), v[b, :n].double(), mask)
        out[b], lse[b] = o, l
    return out, lse


@pytest.mark.parametrize("s_q", [1, 4])
@pytest.mark.parametrize("kwargs,mask", [
    ({}, {"kind": "window", "left": None, "right": 0, "bottom_right": True}),
    ({"causal": False}, {"kind": "none"}),
    ({"window_size": (16, 0)}, {"kind": "window", "left": 16, "right": 0, "bottom_right": True}),
])
def test_paged_and_dense_caches_match_the_naive_attention(s_q, kwargs, mask):
    q = torch.randn(B, s_q, HQ, D).to(DT)
    k, v = _dense()
    lens = torch.tensor(LENS, dtype=torch.int32)
    want_o, want_lse = _want(q, k, v, LENS, mask)
    dense_o, dense_lse = fmha.attention_with_kvcache(q, k, v, lens, return_lse=True, **kwargs)
    for page_size in (16, 32):
        kp, vp, table = _paged(k, v, page_size)
        o, lse = fmha.attention_with_kvcache(q, kp, vp, lens, block_table=table, return_lse=True, **kwargs)
        assert torch.equal(o, dense_o) and torch.equal(lse, dense_lse)
    assert torch.allclose(dense_o.double(), want_o, atol=TOL)
    assert torch.equal(torch.isneginf(dense_lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(dense_lse.double()[finite], want_lse[finite], atol=1e-4)
    assert (dense_o[0] == 0).all()  # an empty cache: no keys, O = 0, LSE = -inf


def test_new_keys_are_written_where_each_sequence_continues_and_attended():
    s_new = 3
    q = torch.randn(B, s_new, HQ, D).to(DT)
    k, v = _dense()
    k_new, v_new = torch.randn(B, s_new, HK, D).to(DT), torch.randn(B, s_new, HK, D).to(DT)
    lens = torch.tensor(LENS, dtype=torch.int32)
    kp, vp, table = _paged(k.clone(), v.clone(), 16)
    got = fmha.attention_with_kvcache(q, kp, vp, lens, block_table=table, k_new=k_new, v_new=v_new)
    dense_k, dense_v = k.clone(), v.clone()
    got_dense = fmha.attention_with_kvcache(q, dense_k, dense_v, lens, k_new=k_new, v_new=v_new)
    assert torch.equal(got, got_dense)
    for b, n in enumerate(LENS):
        assert torch.equal(dense_k[b, n:n + s_new], k_new[b]) and torch.equal(dense_v[b, n:n + s_new], v_new[b])
        assert torch.equal(dense_k[b, :n], k[b, :n]) and torch.equal(dense_k[b, n + s_new:], k[b, n + s_new:])
        for i in range(s_new):
            p = n + i
            assert torch.equal(kp[table[b, p // 16], p % 16], k_new[b, i])
    full_k = torch.stack([torch.cat([k[b, :n], k_new[b], k[b, n + s_new:]]) for b, n in enumerate(LENS)])
    full_v = torch.stack([torch.cat([v[b, :n], v_new[b], v[b, n + s_new:]]) for b, n in enumerate(LENS)])
    want, _ = _want(q, full_k, full_v, [n + s_new for n in LENS],
                    {"kind": "window", "left": None, "right": 0, "bottom_right": True})
    assert torch.allclose(got.double(), want, atol=TOL)


def test_bad_caches_and_block_tables_say_what_to_change():
    q = torch.randn(B, 1, HQ, D).to(DT)
    k, v = _dense()
    lens = torch.tensor(LENS, dtype=torch.int32)
    kp, vp, table = _paged(k, v, 16)
    with pytest.raises(ValueError, match="page size .* multiple of 16"):
        fmha.attention_with_kvcache(q, kp[:, :8].contiguous(), vp[:, :8].contiguous(), lens, block_table=table)
    with pytest.raises(TypeError, match="block_table must be int32"):
        fmha.attention_with_kvcache(q, kp, vp, lens, block_table=table.long())
    with pytest.raises(ValueError, match="block_table has 3 rows"):
        fmha.attention_with_kvcache(q, kp, vp, lens, block_table=table[:3])
    with pytest.raises(ValueError, match=r"cache_seqlens\[3\] = 200 does not fit"):
        fmha.attention_with_kvcache(q, k, v, torch.tensor([0, 1, 37, 200], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_seqlens\[3\] = 100 plus 40 new keys does not fit"):
        fmha.attention_with_kvcache(q, k, v, lens, k_new=k[:, :40].clone(), v_new=v[:, :40].clone())
    broken = table.clone()
    broken[2, 1] = 10_000
    with pytest.raises(ValueError, match=r"block_table\[2, 1\] = 10000 is not a page"):
        fmha.attention_with_kvcache(q, kp, vp, lens, block_table=broken)
    with pytest.raises(ValueError, match="pass both k_new and v_new"):
        fmha.attention_with_kvcache(q, k, v, lens, k_new=k[:, :1].clone())
    with pytest.raises(ValueError, match="dense cache has one row per sequence"):
        fmha.attention_with_kvcache(q, k[:2], v[:2], lens)
    with pytest.raises(ValueError, match="multiple of the cache's K/V heads"):
        fmha.attention_with_kvcache(torch.randn(B, 1, 3, D).to(DT), k, v, lens)
    with pytest.raises(fmha.UnsupportedError):
        fmha.attention_with_kvcache(q, k, v, lens, backend="kernel")
