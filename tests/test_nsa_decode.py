"""NSA decode against the fp64 prefill oracle: a step's rows are the last rows of NSA over each
whole sequence (docs/nsa.md, "Decode"); the compressed caches it keeps equal mean pooling."""

import pytest
import torch

import fmha.nsa as nsa
from fmha.nsa.layout import num_compressed_blocks
from fmha.nsa.reference import mean_pool_reference

GEOMETRY = dict(block=8, stride=4, select_block=16, select_count=3, window=12)


def _full(lens, heads_q, heads_k, d, gen, dtype=torch.float64):
    total = sum(lens)
    q = torch.randn(total, heads_q, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(total, heads_k, d, generator=gen, dtype=dtype) for _ in range(2))
    gates = torch.rand(3, total, heads_q, generator=gen, dtype=dtype)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return q, k, v, gates, cu


def _caches(k, v, cu, lens, s_max, have, geometry):
    """Dense caches holding the first ``have[b]`` tokens of each sequence, and compressed caches
    holding their mean-pooled blocks (what earlier steps left)."""
    b = len(lens)
    heads_k, d = k.shape[1:]
    n_cmp = num_compressed_blocks(s_max, geometry["block"], geometry["stride"])
    kc, vc = (torch.full((b, s_max, heads_k, d), float("nan"), dtype=k.dtype) for _ in range(2))
    kcmp, vcmp = (torch.full((b, n_cmp, heads_k, d), float("nan"), dtype=k.dtype) for _ in range(2))
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), have)):
        kc[i, :n], vc[i, :n] = k[a:a + n], v[a:a + n]
        one = torch.tensor([0, n], dtype=torch.int32)
        c = num_compressed_blocks(n, geometry["block"], geometry["stride"])
        for src, dst in ((k, kcmp), (v, vcmp)):
            dst[i, :c] = mean_pool_reference(src[a:a + n], one, geometry["block"], geometry["stride"])
    return kc, vc, kcmp, vcmp


@pytest.mark.parametrize("lens,s_q,s_new,heads", [
    ([40, 1, 23, 64], 1, 1, (4, 2)),   # one new token per sequence; a length-1 sequence
    ([40, 5, 33], 3, 3, (2, 1)),       # a short prefill of three rows (MTP-style)
    ([50, 17, 9], 2, 5, (6, 3)),       # five new keys, the last two as queries
    ([30, 2], 4, 2, (4, 4)),           # more rows than a sequence has: those see nothing
    ([41, 7], 2, 0, (4, 2)),           # no new keys: the rows are the cache's last tokens
])
def test_decode_step_equals_the_last_rows_of_prefill_nsa(lens, s_q, s_new, heads):
    gen = torch.Generator().manual_seed(sum(lens) + s_q)
    heads_q, heads_k = heads
    q, k, v, gates, cu = _full(lens, heads_q, heads_k, 16, gen)
    want, branches = nsa.nsa_reference(q, k, v, *gates, cu_seqlens=cu, return_branches=True, **GEOMETRY)
    s_max = max(lens) + 3
    have = [max(n - s_new, 0) for n in lens]
    kc, vc, kcmp, vcmp = _caches(k, v, cu, lens, s_max, have, GEOMETRY)
    b = len(lens)
    q_d = torch.zeros(b, s_q, heads_q, 16, dtype=q.dtype)
    g_d = torch.zeros(3, b, s_q, heads_q, dtype=q.dtype)
    k_new, v_new = (torch.zeros(b, s_new, heads_k, 16, dtype=q.dtype) for _ in range(2))
    rows, empty = [], []  # (b, r, packed row) of each query that exists; (b, r) of those that do not
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        assert n >= s_new  # every sequence holds its S_new new keys
        k_new[i], v_new[i] = k[a + have[i]:a + n], v[a + have[i]:a + n]
        for r in range(s_q):
            t = n - s_q + r
            if t >= 0:
                q_d[i, r], g_d[:, i, r] = q[a + t], gates[:, a + t]
                rows.append((i, r, a + t))
            else:  # a row before the sequence's first token
                q_d[i, r], g_d[:, i, r] = torch.randn(heads_q, 16, generator=gen, dtype=q.dtype), 1.0
                empty.append((i, r))
    seqlens = torch.tensor([n - s_new for n in lens], dtype=torch.int32)
    new = dict(k_new=k_new, v_new=v_new) if s_new else {}
    o, got = nsa.nsa_decode(q_d, kc, vc, kcmp, vcmp, seqlens, *g_d, **new, return_branches=True,
                            backend="reference", **GEOMETRY)
    for i, r, t in rows:
        torch.testing.assert_close(o[i, r], want[t], atol=1e-10, rtol=1e-10)
        assert torch.equal(got.selected[i, r], branches.selected[t])
        for name in ("o_cmp", "o_slc", "o_win"):
            torch.testing.assert_close(getattr(got, name)[i, r], getattr(branches, name)[t], atol=1e-10, rtol=1e-10)
    for i, r in empty:  # sees no key in any branch
        assert torch.equal(o[i, r], torch.zeros_like(o[i, r]))
    assert all(n >= s_q for n in lens) or empty
    # the compressed caches now hold every block of each whole sequence
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        c = num_compressed_blocks(n, GEOMETRY["block"], GEOMETRY["stride"])
        one = torch.tensor([0, n], dtype=torch.int32)
        torch.testing.assert_close(kcmp[i, :c], mean_pool_reference(k[a:a + n], one, 8, 4))
        torch.testing.assert_close(vcmp[i, :c], mean_pool_reference(v[a:a + n], one, 8, 4))
        assert torch.isnan(kcmp[i, c:]).all()  # nothing written past the complete blocks


def test_a_decode_loop_tracks_prefill_token_by_token():
    """Steps of one new token each from an empty cache: every step's output is prefill NSA's row."""
    gen = torch.Generator().manual_seed(5)
    lens = [37, 21]
    q, k, v, gates, cu = _full(lens, 4, 2, 16, gen)
    want = nsa.nsa_reference(q, k, v, *gates, cu_seqlens=cu, **GEOMETRY)
    kc, vc, kcmp, vcmp = _caches(k, v, cu, lens, 40, [0, 0], GEOMETRY)
    seqlens = torch.zeros(2, dtype=torch.int32)
    starts = cu[:-1].tolist()
    for step in range(max(lens)):
        live = [step < n for n in lens]
        pick = [a + min(step, n - 1) for a, n in zip(starts, lens)]
        o = nsa.nsa_decode(q[pick][:, None], kc, vc, kcmp, vcmp, seqlens, *(g[pick][:, None] for g in gates),
                           k_new=k[pick][:, None], v_new=v[pick][:, None], backend="reference", **GEOMETRY)
        for i, ok in enumerate(live):
            if ok:
                torch.testing.assert_close(o[i, 0], want[pick[i]], atol=1e-10, rtol=1e-10)
        seqlens = seqlens + torch.tensor(live, dtype=torch.int32)


def test_bad_caches_are_refused_with_what_to_change():
    q = torch.zeros(2, 1, 4, 16)
    kc = torch.zeros(2, 40, 2, 16)
    small = torch.zeros(2, 3, 2, 16)
    g = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="at least 9 blocks"):
        nsa.nsa_decode(q, kc, kc, small, small, torch.zeros(2, dtype=torch.int32), g, g, g, **GEOMETRY)
    cmp = torch.zeros(2, 9, 2, 16)
    with pytest.raises(ValueError, match="g_slc must be a"):
        nsa.nsa_decode(q, kc, kc, cmp, cmp, torch.zeros(2, dtype=torch.int32), g, g[:, :, :2], g, **GEOMETRY)
    with pytest.raises(ValueError, match="like its cache"):
        nsa.nsa_decode(q, kc, kc, cmp.double(), cmp, torch.zeros(2, dtype=torch.int32), g, g, g, **GEOMETRY)


def test_pool_false_leaves_the_compressed_caches_to_the_caller():
    gen = torch.Generator().manual_seed(11)
    lens = [36]  # the new key (position 35) completes compressed block 7 ([28, 36))
    q, k, v, gates, cu = _full(lens, 2, 1, 16, gen)
    kc, vc, kcmp, vcmp = _caches(k, v, cu, lens, 40, [35], GEOMETRY)
    before = kcmp.clone()
    args = (q[None, 35:36], kc, vc, kcmp, vcmp, torch.tensor([35], dtype=torch.int32), *(g[None, 35:36] for g in gates))
    nsa.nsa_decode(*args, k_new=k[None, 35:36], v_new=v[None, 35:36], pool=False, backend="reference", **GEOMETRY)
    assert torch.equal(kcmp.nan_to_num(7.0), before.nan_to_num(7.0))  # not pooled: the caller's job
    assert torch.isnan(kcmp[0, 7]).all()
    kc, vc, kcmp, vcmp = _caches(k, v, cu, lens, 40, [35], GEOMETRY)
    nsa.nsa_decode(*args[:1], kc, vc, kcmp, vcmp, *args[5:], k_new=k[None, 35:36], v_new=v[None, 35:36],
                   backend="reference", **GEOMETRY)
    torch.testing.assert_close(kcmp[0, 7], k[28:36].mean(0))


def test_full_caches_never_write_past_them():
    """A step that would grow a sequence past its cache: the reference refuses it (the kernels
    flag it); the compressed pooling of such lengths stays inside the caches."""
    gen = torch.Generator().manual_seed(12)
    lens = [40]
    q, k, v, gates, cu = _full(lens, 2, 1, 16, gen)
    kc, vc, kcmp, vcmp = _caches(k, v, cu, lens, 40, [40], GEOMETRY)
    one = (g[None, :1] for g in gates)
    with pytest.raises(ValueError, match="does not fit"):
        nsa.nsa_decode(q[None, :1], kc, vc, kcmp, vcmp, torch.tensor([40], dtype=torch.int32), *one,
                       k_new=k[None, :1], v_new=v[None, :1], backend="reference", **GEOMETRY)
    before = kcmp.clone()
    nsa.pool_new_blocks(kc, vc, kcmp, vcmp, torch.tensor([40]), torch.tensor([48]), 8, 4, 8)
    assert torch.equal(kcmp, before)  # every block of 40 tokens is there; none past the cache
