"""The host side of decode (``fmha.split_kv``) and the tile arithmetic the decode kernel shares
with the host (``fmha.masking``), on the CPU: a GQA group packed into rows and back is the
identity, the split share of a tile schedule covers each visited tile once with its masking class, and
packed rows get the K/V tiles of their query positions."""

import pytest
import torch

from fmha import split_kv
from fmha.kernels.common.kv_walk import KvWalk, kv_walk
from fmha.masking import MaskKind, row_key_bounds


def test_pack_then_unpack_is_the_identity():
    b, s, hk, g, d = 2, 3, 2, 4, 8
    q = torch.randn(b, s, hk * g, d)
    packed = split_kv.pack_gqa(q, hk)
    assert packed.shape == (b, s * g, hk, d)
    # row s * g + j of K/V head h is query position s of head h * g + j
    assert torch.equal(packed[1, 2 * g + 3, 1], q[1, 2, 1 * g + 3])
    lse = torch.randn(b, hk, s * g)
    out, lse_out = torch.empty_like(q), torch.empty(b, hk * g, s)
    split_kv.unpack_gqa(packed, lse, s, out, lse_out)
    assert torch.equal(out, q)
    assert lse_out[1, 1 * g + 3, 2] == lse[1, 1, 2 * g + 3]


def test_one_query_row_packs_as_more_rows_do():
    """pack_gqa's one-row shortcut (one strided view) gives what the general packing gives."""
    b, hk, g, d = 3, 2, 4, 8
    q = torch.randn(b, 1, hk * g, 2 * d)[..., :d]  # rows wider than D: strides stay general
    general = q.reshape(b, 1, hk, g, d).transpose(2, 3).reshape(b, g, hk, d)
    assert torch.equal(split_kv.pack_gqa(q, hk), general)


def test_one_query_row_is_packed_as_views_of_the_callers_tensors():
    """With S_q = 1 the packed O and LSE are views of out and lse (the decode kernel writes them in
    place): writing packed rows through the views is what unpack_gqa would have written. More
    rows get None (but for O alone with one K/V head): the runner then packs and unpacks."""
    b, hk, g, d = 3, 2, 4, 8
    out, lse = torch.zeros(b, 1, hk * g, d), torch.zeros(b, hk * g, 1)
    o_view, lse_view = split_kv.packed_views(out, lse, hk, 1)
    assert o_view.data_ptr() == out.data_ptr() and lse_view.data_ptr() == lse.data_ptr()
    packed_o, packed_lse = torch.randn(b, g, hk, d), torch.randn(b, hk, g)
    want_o, want_lse = torch.empty_like(out), torch.empty_like(lse)
    split_kv.unpack_gqa(packed_o, packed_lse, 1, want_o, want_lse)
    o_view.copy_(packed_o)
    lse_view.copy_(packed_lse)
    assert torch.equal(out, want_o) and torch.equal(lse, want_lse)
    assert split_kv.packed_views(out, None, hk, 1)[1] is None
    assert split_kv.packed_views(torch.zeros(b, 2, hk * g, d), None, hk, 2) is None  # two rows
    wide = torch.zeros(b, 1, hk * g, 2 * d)[..., :d]  # rows of 2D: still a view
    assert split_kv.packed_views(wide, None, hk, 1) is not None
    assert split_kv.packed_views(torch.zeros(b, 2, g, d), None, 1, 2) is not None  # one K/V head, no LSE


def test_num_splits_fill_the_gpu_only_when_the_tiles_do_not():
    assert split_kv.choose_num_splits(num_tiles=512, num_sms=132, kv_tiles=64) == 1
    n = split_kv.choose_num_splits(num_tiles=8, num_sms=132, kv_tiles=1024)  # B=1, 8 K/V heads, 131k keys
    assert 8 <= n <= split_kv.MAX_SPLITS and 8 * n <= 132 * 1.2
    assert split_kv.choose_num_splits(num_tiles=8, num_sms=132, kv_tiles=3) == 1  # too few tiles to share
    assert split_kv.choose_num_splits(num_tiles=0, num_sms=132, kv_tiles=10) == 1


@pytest.mark.parametrize("start,lead,full,trail", [(0, 1, 10, 1), (3, 2, 0, 0), (0, 0, 7, 1), (5, 0, 0, 0)])
@pytest.mark.parametrize("num_splits", [1, 2, 3, 8, 20])
def test_split_shares_cover_each_tile_once_with_its_class(start, lead, full, trail, num_splits):
    whole = KvWalk(start, lead, full, trail)
    classes = {}
    for t in range(start, start + whole.total):
        classes[t] = t < start + lead or t >= start + lead + full  # masked?
    seen = {}
    for split in range(num_splits):
        part = whole.split_share(split, num_splits)
        assert part.total >= 0 and min(part.leading_masked, part.unmasked, part.trailing_masked) >= 0
        for i in range(part.total):
            t = part.start + i
            masked = i < part.leading_masked or i >= part.leading_masked + part.unmasked
            assert t not in seen and classes[t] == masked
            seen[t] = split
    assert sorted(seen) == list(classes)


@pytest.mark.parametrize("rows_per_query", [1, 4, 8])
@pytest.mark.parametrize("window", [(None, 0), (5, 0), (None, None), (17, 3)])
def test_packed_rows_visit_the_tiles_of_their_positions(rows_per_query, window):
    tile_m, tile_n = 16, 8
    positions, seqlen_k = 9, 61
    rows = positions * rows_per_query
    left, right = window
    kind = MaskKind.NONE if window == (None, None) else MaskKind.WINDOW
    for m_block in range(-(-rows // tile_m)):
        sched = kv_walk(m_block, tile_m, tile_n, rows, seqlen_k, kind, left, right, True,
                                 rows_per_query=rows_per_query)
        first, last = m_block * tile_m, min((m_block + 1) * tile_m, rows) - 1
        kept = set()
        for r in range(first, last + 1):
            lo, hi = row_key_bounds(r // rows_per_query, positions, seqlen_k, kind, left, right, True)
            kept |= {key // tile_n for key in range(lo, hi)}
        visited = set(range(sched.start, sched.start + sched.total))
        assert kept == visited


def test_decode_problems_the_kernel_cannot_serve_say_why():
    from fmha.kernels.hopper.config import why_unsupported_decode
    from fmha.kvcache import decode_problem

    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)
    lengths = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="new keys do not fit"):
        decode_problem(q, k, k, lengths, k_new=torch.zeros(2, 33, 2, 64, dtype=torch.bfloat16),
                       v_new=torch.zeros(2, 33, 2, 64, dtype=torch.bfloat16))
    # V's head dim may differ from Q's (a multiple of 16 up to 256), not leave that range
    problem, _ = decode_problem(q, k, torch.zeros(2, 32, 2, 32, dtype=torch.bfloat16), lengths)
    assert why_unsupported_decode(problem) == []
    problem, _ = decode_problem(q, k, torch.zeros(2, 32, 2, 40, dtype=torch.bfloat16), lengths)
    assert any("multiples of 16" in r for r in why_unsupported_decode(problem))
    pages = torch.zeros(10, 64, 2, 256, dtype=torch.bfloat16)
    problem, _ = decode_problem(torch.zeros(2, 1, 8, 256, dtype=torch.bfloat16), pages, pages, lengths,
                                block_table=torch.zeros(2, 5, dtype=torch.int32))
    assert any("multiple of 80" in r for r in why_unsupported_decode(problem))
    problem, _ = decode_problem(q, k, k, lengths)
    assert why_unsupported_decode(problem) == []


def test_a_repeated_kernel_call_reuses_its_validation(monkeypatch):
    """attention_with_kvcache's dispatch memo: the same shapes, strides, dtypes and arguments skip
    validation and dispatch; a new shape or argument takes the full path again."""
    from fmha import backends, kvcache

    calls = {"validate": 0, "run": 0}
    real = kvcache.decode_problem

    def counting(*args, **kwargs):
        calls["validate"] += 1
        return real(*args, **kwargs)

    def runner(problem, q, k, v, lengths, table, out, lse, sinks=None, cu_seqlens_q=None):
        calls["run"] += 1
        out.zero_()

    monkeypatch.setattr(kvcache, "decode_problem", counting)
    monkeypatch.setattr(kvcache, "_decode_runner", lambda backend, problem: runner)
    monkeypatch.setattr(kvcache.device_errors, "raise_pending", lambda device: None)
    monkeypatch.setattr(kvcache.device_errors, "watch", lambda device: None)
    backends.clear_cache()
    q = torch.zeros(2, 1, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)
    lengths = torch.tensor([3, 7], dtype=torch.int32)
    for _ in range(3):
        kvcache.attention_with_kvcache(q, k, k, lengths)
    assert calls == {"validate": 1, "run": 3}
    kvcache.attention_with_kvcache(q, k, k, lengths, causal=False)  # another argument
    kvcache.attention_with_kvcache(torch.zeros(2, 2, 8, 64, dtype=torch.bfloat16), k, k, lengths)  # another shape
    assert calls == {"validate": 3, "run": 5}
    with pytest.raises(TypeError):  # a bad call is never memoized: it fails every time
        kvcache.attention_with_kvcache(q.float(), k, k, lengths)
    backends.clear_cache()
