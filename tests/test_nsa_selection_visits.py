"""The selection kernel's visits (``fmha.nsa.selection_visits``), checked on the CPU by running
them the way the kernel does (``emulate``: each query tile of a few tokens' GQA heads walks its
entries, a tile of keys from each entry's first row, masked per token by the entry's bits where
the entry is listed as masked) and comparing with the PyTorch gather path in fp64: GQA groups of
2, 4, 8 and 16 (bit 31 used at 2), selection blocks below, equal to and above the key tile,
empty and length-1 sequences, -1 and future entries, blocks an unchecked list names twice."""

import math

import pytest
import torch

from fmha.nsa import selection as S
from fmha.nsa.selection_visits import selection_backward_visits, selection_visits
from test_nsa_selection_blocks import _case

TILE_M, TILE_N = 64, 64


def emulate(q, k, v, sel, cu, select_block, scale):
    """(o, lse) of the visits as the kernel computes them, and the kept (row, key) pairs."""
    total, heads_q, _ = q.shape
    heads_k = k.shape[1]
    g = heads_q // heads_k
    per_tile = TILE_M // g
    visits = selection_visits(sel, cu, select_block, per_tile, TILE_N)
    counts, rows, bits = (t[0] for t in visits)
    length = min(select_block, TILE_N)
    o = torch.zeros(total, heads_q, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads_q, total), -math.inf, dtype=torch.float64)
    kept_all = torch.zeros(heads_k, total * g, total, dtype=torch.int64)
    for h in range(heads_k):
        for m in range(counts.shape[1]):
            r0 = m * TILE_M
            row_ids = torch.arange(r0, min(r0 + TILE_M, total * g))
            tokens = row_ids // g
            keep = torch.zeros(row_ids.numel(), total, dtype=torch.bool)
            masked, whole = int(counts[h, m, 0]), int(counts[h, m, 1])
            for e in range(masked + whole):
                start = int(rows[h, m, e])
                keys = torch.arange(start, min(start + TILE_N, total))
                if e >= masked:  # unmasked: the whole tile of keys, for every row
                    assert start + TILE_N <= total
                    keep[:, keys] = True
                    kept_all[h, row_ids[:, None], keys[None, :]] += 1
                    continue
                chose = ((int(bits[h, m, e]) & 0xFFFFFFFF) >> (tokens - m * per_tile)) & 1
                k_ok = (keys[None, :] < start + length) & (keys[None, :] <= tokens[:, None]) & (chose[:, None] == 1)
                keep[:, keys] |= k_ok
                kept_all[h, row_ids[:, None], keys[None, :]] += k_ok.long()
            heads = h * g + row_ids % g
            s = torch.einsum("rd,rkd->rk", q[tokens, heads], k[None, :, h].expand(row_ids.numel(), -1, -1)) * scale
            s = s.masked_fill(~keep, -math.inf)
            mx = s.amax(-1, keepdim=True)
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            p = (s - mx).exp()
            den = p.sum(-1, keepdim=True)
            o[tokens, heads] = (p @ v[:, h]) / torch.where(den > 0, den, torch.ones_like(den))
            lse[heads, tokens] = torch.where(den[:, 0] > 0, mx[:, 0] + den[:, 0].log(), -math.inf)
    return o, lse, kept_all


CASES = [([0, 1, 70, 130, 5], 16, 2, 64, 3), ([200, 77], 8, 2, 32, 4), ([33, 0, 97], 4, 1, 16, 5),
         ([150, 1], 2, 1, 100, 2), ([300, 3], 4, 2, 128, 3), ([129], 2, 1, 64, 3), ([260, 70], 16, 1, 64, 4)]


@pytest.mark.parametrize("lens,heads_q,heads_k,select_block,count", CASES)
def test_the_visits_compute_selection_attention(lens, heads_q, heads_k, select_block, count):
    if select_block > TILE_N and select_block % TILE_N:
        with pytest.raises(ValueError, match="neither at most one key tile"):
            selection_visits(torch.zeros(1, 1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                             select_block, 4, TILE_N)
        return
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=len(lens) * 7 + select_block)
    scale = 0.3
    want_o, want_lse = S._selection_forward_torch(q, k, v, sel, cu, select_block, scale)
    o, lse, kept = emulate(q, k, v, sel, cu, select_block, scale)
    assert int(kept.max()) <= 1  # no key is counted twice for a row
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-10)
    assert torch.allclose(o, want_o, atol=1e-10)


def test_whole_entries_skip_the_mask_and_come_last():
    """Four tokens of one sequence all choosing blocks 0 and 1 before them: both whole, listed
    after the blocks only some chose; the current block (it holds the tokens) stays masked."""
    total, p = 260, 4
    cu = torch.tensor([0, total], dtype=torch.int32)
    sel = torch.full((total, 1, 3), -1, dtype=torch.int32)
    for t in range(total):
        sel[t, 0] = torch.tensor([0, 1, t // 64]) if t >= 128 else torch.tensor([t // 64, -1, -1])
    sel[200, 0, 1] = 3  # block 3 lies after token 200: dropped, and block 1 not chosen by it
    counts, rows, bits = (t[0, 0] for t in selection_visits(sel, cu, 64, p, 64))
    m = 192 // p  # tokens 192..195
    assert counts[m].tolist() == [1, 2] and rows[m, :3].tolist() == [192, 0, 64] and bits[m, 0] == 0b1111
    m = 200 // p  # tokens 200..203: 200 did not choose block 1
    assert counts[m].tolist() == [2, 1] and rows[m, :3].tolist() == [64, 192, 0]
    assert bits[m, 0] == 0b1110


def test_a_block_named_twice_counts_once_and_bit_31_is_kept():
    total, p = 64, 32  # two heads per group: 32 tokens per tile
    cu = torch.tensor([0, total], dtype=torch.int32)
    sel = torch.zeros((total, 1, 2), dtype=torch.int32)  # block 0, twice
    counts, rows, bits = (t[0, 0] for t in selection_visits(sel, cu, 64, p, 64))
    assert counts.tolist() == [[1, 0], [1, 0]] and rows[:, 0].tolist() == [0, 0]
    assert bits[0, 0] == -1 and bits[1, 0] == -1  # all 32 tokens: bit 31 is the sign bit


BWD_TILE_N = 128  # the backward's K/V tile: two warpgroups of 64 keys


def emulate_backward(q, k, v, out, lse, dout, sel, cu, select_block, scale, tile_m):
    """(dq, dk, dv) of the backward's lists as the kernel computes them (each K/V tile of a
    sequence walks its listed query tiles of packed GQA rows; a masked entry keeps, per half of
    the tile, the keys up to each position whose bit is set), and the kept (query head, token,
    key) counts."""
    total, heads_q, _ = q.shape
    heads_k = k.shape[1]
    g = heads_q // heads_k
    p = tile_m // g
    chunk_base, offsets, masked_end, tiles, positions, _ = selection_backward_visits(sel, cu, select_block, p,
                                                                                  BWD_TILE_N)
    chunks = masked_end.numel() // heads_k
    delta = (dout * out).sum(-1)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kept_all = torch.zeros(heads_q, total, total, dtype=torch.int64)
    for b in range(cu.numel() - 1):
        start, length = int(cu[b]), int(cu[b + 1] - cu[b])
        for c in range(-(-length // BWD_TILE_N)):
            n0 = c * BWD_TILE_N
            keys = torch.arange(n0, min(n0 + BWD_TILE_N, length))
            half = (keys - n0) // (BWD_TILE_N // 2)
            for h in range(heads_k):
                at = h * chunks + int(chunk_base[b]) + c
                for i in range(int(offsets[at]), int(offsets[at + 1])):
                    m = int(tiles[i])
                    rows = torch.arange(m * tile_m, min((m + 1) * tile_m, length * g))
                    assert rows.numel() > 0
                    tok, heads = rows // g, h * g + rows % g
                    if i < int(masked_end[at]):
                        word = positions[i].long() & 0xFFFFFFFF
                        chose = (word[half][None, :] >> (tok - m * p)[:, None]) & 1
                        keep = (chose == 1) & (keys[None, :] <= tok[:, None])
                    else:  # whole: every row keeps every key of the (full) tile
                        assert n0 + BWD_TILE_N <= length and n0 + BWD_TILE_N - 1 <= m * p
                        keep = torch.ones(rows.numel(), keys.numel(), dtype=torch.bool)
                    ta, ka = start + tok, start + keys
                    qs, dos = q[ta, heads], dout[ta, heads]
                    s = qs @ k[ka, h].T * scale
                    pr = torch.where(keep, (s - lse[heads, ta][:, None]).exp(), torch.zeros_like(s))
                    ds = pr * (dos @ v[ka, h].T - delta[ta, heads][:, None])
                    dv[ka, h] += pr.T @ dos
                    dk[ka, h] += ds.T @ qs * scale
                    dq.index_put_((ta, heads), ds @ k[ka, h] * scale, accumulate=True)
                    kept_all[heads[:, None], ta[:, None], ka[None, :]] += keep.long()
    return dq, dk, dv, kept_all


def _kept_by_the_lists(sel, cu, select_block, heads_q):
    """(query head, token, key) pairs selection attention keeps, from the lists directly."""
    total, heads_k, _ = sel.shape
    g = heads_q // heads_k
    kept = torch.zeros(heads_q, total, total, dtype=torch.int64)
    for b in range(cu.numel() - 1):
        start, end = int(cu[b]), int(cu[b + 1])
        for t in range(start, end):
            for h in range(heads_k):
                for j in set(int(x) for x in sel[t, h] if x >= 0):
                    lo, hi = start + j * select_block, min(start + (j + 1) * select_block, t + 1)
                    if lo < hi:
                        kept[h * g:(h + 1) * g, t, lo:hi] = 1
    return kept


BWD_CASES = [([0, 1, 70, 330, 5], 16, 2, 64, 3, 64), ([300, 77], 8, 2, 128, 4, 64),
             ([260, 0, 140], 4, 1, 64, 5, 128), ([129, 1], 2, 1, 192, 3, 64), ([400], 32, 1, 64, 6, 64),
             ([0, 1, 70, 330, 5], 16, 1, 64, 4, 16), ([300, 77, 1], 8, 2, 128, 5, 32)]


@pytest.mark.parametrize("lens,heads_q,heads_k,select_block,count,tile_m", BWD_CASES)
def test_the_backward_visits_compute_the_selection_gradients(lens, heads_q, heads_k, select_block, count, tile_m):
    """GQA groups of 2 to 32 (32 and 2 positions per query tile: bit 31 used; one position per
    16-row tile), query tiles of 16 to 128 rows, blocks of 64, 128 and 192 keys (a K/V tile's halves in different blocks, or in
    one), empty and length-1 sequences, future blocks in the lists: every kept pair counted once,
    and the gradients equal the gather path's in fp64."""
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=len(lens) * 5 + select_block)
    scale = 0.3
    out, lse = S._selection_forward_torch(q, k, v, sel, cu, select_block, scale)
    dout = torch.randn_like(out)
    want = S._selection_backward_torch(dout, q, k, v, out, lse, None, sel, cu, select_block, scale)
    *got, kept = emulate_backward(q, k, v, out, lse, dout, sel, cu, select_block, scale, tile_m)
    assert torch.equal(kept, _kept_by_the_lists(sel, cu, select_block, heads_q))
    for name, a, b in zip("dq dk dv".split(), got, want):
        assert torch.allclose(a, b, atol=1e-10), name
    if count > 2:  # a block an unchecked list names twice counts once (the gather path counts it twice)
        sel[1::5, :, -1] = sel[1::5, :, -2]
        *_, kept = emulate_backward(q, k, v, out, lse, dout, sel, cu, select_block, scale, tile_m)
        assert torch.equal(kept, _kept_by_the_lists(sel, cu, select_block, heads_q))


def test_backward_entries_every_position_keeps_whole_come_last():
    """Every position from 128 on chose blocks 0 and 1 (K/V tile 0's halves): the query tiles
    from position 128 on list K/V tile 0 as whole, after the masked ones before them."""
    total, p = 300, 8
    cu = torch.tensor([0, total], dtype=torch.int32)
    sel = torch.full((total, 1, 3), -1, dtype=torch.int32)
    for t in range(total):
        sel[t, 0] = torch.tensor([0, 1, t // 64]) if t >= 128 else torch.tensor([t // 64, -1, -1])
    chunk_base, offsets, masked_end, tiles, positions, _ = selection_backward_visits(sel, cu, 64, p, BWD_TILE_N)
    assert chunk_base.tolist() == [0, 3]
    start, masked, end = int(offsets[0]), int(masked_end[0]), int(offsets[1])
    assert sorted(tiles[start:masked].tolist()) == list(range(128 // p))  # positions 0..127 (some not all)
    assert sorted(tiles[masked:end].tolist()) == list(range(128 // p, -(-total // p)))
    for m, pair in zip(tiles[masked:end].tolist(), positions[masked:end].tolist()):
        everyone = (1 << min(p, total - m * p)) - 1  # the last tile holds 4 positions
        assert pair == [everyone, everyone]


@pytest.mark.parametrize("split,deterministic", [(False, False), (True, False), (True, True)])
def test_the_selection_backward_launch_packs_rows_and_unpacks_dq(monkeypatch, split, deterministic):
    """The selection backward's host side (``HopperSelectionBackwardRunner``) with its three
    compiled passes replaced by PyTorch ones that read only what the launch hands them (the
    packed rows, their offsets, the LSE rows and the visits, as the kernel reads them; each list
    walked in its shares, one per CTA, a split list's dK and dV added into the fp32
    accumulators): the gradients equal the gather path's in fp64, so the packing, the row offsets
    (cu_seqlens * g), the shares, the split keys' conversion and dQ's unpacking agree with the
    kernel's reading of them. ``split``: shares of a single entry (fmha's default is 128 entries),
    so that most lists are cut. ``deterministic``: the launch also gets the K/V tiles in sequence
    order, each entry's turn and zeroed turn counters (``selection_backward_order``)."""
    from fmha import device_errors
    from fmha.kernels.hopper import selection_runner as R
    from fmha.kernels.hopper.backward_runner import BackwardArgs
    from fmha.nsa import selection_visits as V
    from fmha.nsa.selection_visits import SelectionProblem
    from fmha.problem import KernelOptions

    if split:
        monkeypatch.setattr(V, "MIN_PIECE_ENTRIES", 1)
    lens, heads_q, heads_k, select_block, count = [70, 0, 1, 300], 8, 2, 64, 4
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=3)
    scale = 0.3
    out, lse = S._selection_forward_torch(q, k, v, sel, cu, select_block, scale)
    dout = torch.randn_like(out)
    want = S._selection_backward_torch(dout, q, k, v, out, lse, None, sel, cu, select_block, scale)
    problem = SelectionProblem.of(q, k, v, select_block)
    cfg = R.backward_config_of(problem, KernelOptions(deterministic=deterministic))
    assert cfg.deterministic == deterministic and cfg.tiles_listed_by_launch != deterministic
    g = heads_q // heads_k
    dq_rows_seen, cut = {}, []

    def row_pass(out_r, dout_r, lse_r, dlse_r, lse2, delta, dq_acc, cu_q, delta_scale):
        lse2.copy_(lse_r)  # natural units here: the emulated kernel below takes them so
        delta.copy_((out_r * dout_r).sum(-1).transpose(0, 1))

    def kernel(*args):
        a = BackwardArgs(*args)
        a.mdK.zero_()  # the kernel writes every row of dK and dV; here they are added up
        a.mdV.zero_()
        chunk_base, offsets, masked_end, tiles, positions, pieces, dk_acc, dv_acc = a.mBlockLists[:8]
        assert len(a.mBlockLists) == (10 if deterministic else 8)
        if deterministic:  # the tiles in sequence order with their count, each entry's turn, zeroed counters
            in_order = [(b, n) for b, x in enumerate(lens) for n in range(-(-x // cfg.tile_n))]
            assert int(a.mTileCount[0]) == len(in_order)
            assert [tuple(r) for r in a.mTileTable[:len(in_order)].tolist()] == in_order
            turns, dkv_turns = a.mBlockLists[8:]
            assert turns.numel() == tiles.numel() and not dkv_turns.any() and not a.mSemaphores.any()
            assert a.mSemaphores.shape[:2] == (1, heads_k)
        assert dk_acc.dtype == dv_acc.dtype == torch.float32
        assert not cfg.list_pieces > 1 or not (dk_acc.any() or dv_acc.any())  # zeroed where lists may split
        chunks = masked_end.numel() // heads_k
        rows_q = torch.zeros(a.mQ.shape, dtype=torch.float64)
        for b in range(a.mCuSeqlensK.numel() - 1):
            q0, k0 = int(a.mCuSeqlensQ[b]), int(a.mCuSeqlensK[b])
            rows_b, keys_b = int(a.mCuSeqlensQ[b + 1]) - q0, int(a.mCuSeqlensK[b + 1]) - k0
            assert rows_b == keys_b * g
            for c in range(-(-keys_b // cfg.tile_n)):
                keys = torch.arange(c * cfg.tile_n, min((c + 1) * cfg.tile_n, keys_b))
                half = (keys - c * cfg.tile_n) // 64
                for h in range(heads_k):
                    at = h * chunks + int(chunk_base[b]) + c
                    start, end, shares = int(offsets[at]), int(offsets[at + 1]), int(pieces[at])
                    assert 1 <= shares <= cfg.list_pieces
                    cut.append(shares > 1)
                    share = -(-(end - start) // shares)
                    for piece in range(shares):  # one CTA each: bwd.SelectedQueryVisits.range
                        first = min(start + piece * share, end)
                        walk_share(a, range(first, min(first + share, end)), shares > 1, dk_acc, dv_acc, rows_q,
                                   b, c, h, q0, k0, rows_b, keys, half, tiles, positions, masked_end[at])
        dq_rows_seen["rows"] = rows_q

    def walk_share(a, entries, into_partials, dk_acc, dv_acc, rows_q, b, c, h, q0, k0, rows_b, keys, half, tiles,
                   positions, masked_end):
        """One CTA: its share of a K/V tile's list; dK and dV stored, or added in fp32 where split."""
        dk_part, dv_part = (torch.zeros(keys.numel(), t.shape[-1], dtype=torch.float64) for t in (a.mdK, a.mdV))
        for i in entries:
            m = int(tiles[i])
            rows = torch.arange(m * cfg.tile_m, min((m + 1) * cfg.tile_m, rows_b))
            tok = rows // g
            word = positions[i].long() & 0xFFFFFFFF
            keep = (((word[half][None, :] >> (tok - m * (cfg.tile_m // g))[:, None]) & 1) == 1) & \
                (keys[None, :] <= tok[:, None])
            if i >= int(masked_end):
                keep = torch.ones_like(keep)
            qs, dos, ks, vs = a.mQ[q0 + rows, h], a.mdO[q0 + rows, h], a.mK[k0 + keys, h], a.mV[k0 + keys, h]
            s = qs @ ks.T * scale
            p = torch.where(keep, (s - a.mLSE2[0, h, q0 + rows][:, None]).exp(), torch.zeros_like(s))
            ds = p * (dos @ vs.T - a.mDelta[0, h, q0 + rows][:, None])
            dv_part += p.T @ dos
            dk_part += ds.T @ qs * scale
            rows_q[q0 + rows, h] += ds @ ks * scale
        if into_partials:
            dk_acc[k0 + keys, h] += dk_part.float()
            dv_acc[k0 + keys, h] += dv_part.float()
        else:
            a.mdK[k0 + keys, h] = dk_part.to(a.mdK.dtype)
            a.mdV[k0 + keys, h] = dv_part.to(a.mdV.dtype)

    runner = object.__new__(R.HopperSelectionBackwardRunner)
    runner.cfg = cfg
    runner.runner = R.HopperBackwardRunner(cfg, kernel)
    monkeypatch.setattr(runner.runner, "row_pass", lambda has_dlse: row_pass)
    monkeypatch.setattr(device_errors, "flag", lambda device: torch.zeros(1, dtype=torch.int32))  # a GPU's flag
    monkeypatch.setattr(runner.runner, "dq_convert", lambda: lambda acc, dq, cu_q, rows: dq.copy_(dq_rows_seen["rows"]))
    got = runner(problem, dout, q, k, v, out, lse, None, sel, cu, scale)
    assert any(cut) == split
    for name, a, b in zip("dq dk dv".split(), got, want):
        # the LSE and delta rows are fp32, as the kernel's; so are split lists' dK and dV
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (name, float((a - b).abs().max()))


def test_the_selection_kernels_say_what_they_do_not_serve():
    """The selection kernels' refusals (``why_unsupported_selection``/``_backward``): each names
    what to change, and the problems the GPU check runs are served; a refused backward falls
    back to the block-mask form, which serves the rest."""
    from fmha.kernels.hopper import selection_runner as R
    from fmha.nsa.selection_visits import SelectionProblem

    def problem(dtype=torch.bfloat16, d=128, d_v=128, heads_q=16, heads_k=2, select_block=64):
        return SelectionProblem(dtype, d, d_v, heads_q, heads_k, select_block, torch.device("cpu"))

    for served in (problem(), problem(d=96, d_v=96, heads_q=8, heads_k=1), problem(d=128, d_v=64, heads_q=4),
                   problem(torch.float16, 64, 128, 32, 2), problem(select_block=192, heads_q=2, heads_k=1)):
        assert R.why_unsupported_selection_backward(served) == [], served
    refusals = {
        "float16/bfloat16": problem(torch.float32),
        "multiples of 32 up to 128": problem(d=192, d_v=64),
        "multiples of 64 keys": problem(select_block=32),
        "GQA groups": problem(heads_q=2, heads_k=2),
    }
    for words, refused in refusals.items():
        reasons = R.why_unsupported_selection_backward(refused)
        assert len(reasons) == 1 and words in reasons[0], (words, reasons)
    assert "GQA groups of 2 to 64" in R.why_unsupported_selection(problem(heads_q=3, heads_k=1))[0]
    assert "multiple of 64" in R.why_unsupported_selection(problem(select_block=96))[0]


@pytest.mark.parametrize("residents", [1, 3, 64])
def test_the_deterministic_order_adds_in_turn_and_never_deadlocks(monkeypatch, residents):
    """``selection_backward_order``: the K/V tiles listed in sequence order, each entry's turn its
    rank by K/V tile among the entries of its query tile, the split lists' shares in order. The
    kernel's CTAs (``bwd.work_tile``'s mapping of the grid) emulated as steps that wait as its dQ
    writer and consumers do, started in grid order with ``residents`` running at once and each
    step taken by a random running CTA whose wait is met: every CTA finishes (each wait is on an
    earlier CTA), and each query tile's adds come in K/V tile order, each split list's in share
    order."""
    import random

    from fmha.kernels.hopper import dq_layout
    from fmha.kernels.hopper.backward_runner import tile_capacity
    from fmha.nsa import selection_visits as V

    monkeypatch.setattr(V, "MIN_PIECE_ENTRIES", 1)  # most lists cut into shares
    lens, heads_q, heads_k, select_block, count, tile_m, tile_n, max_pieces = [300, 0, 1, 77, 260], 8, 2, 64, 4, 16, 128, 4
    g = heads_q // heads_k
    _, _, _, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=7)
    total, batch = int(cu[-1]), len(lens)
    visits = V.selection_backward_visits(sel, cu, select_block, tile_m // g, tile_n, max_pieces, sms=16)
    dq_tiles = dq_layout.varlen_tiles(total * g, batch, tile_m)
    order = V.selection_backward_order(visits, tile_capacity(total, batch, tile_n), heads_k, tile_n, dq_tiles)
    in_order = [(b, n) for b in range(batch) for n in range(-(-lens[b] // tile_n))]
    assert int(order.count[0]) == len(in_order)
    assert [tuple(r) for r in order.tiles[:len(in_order)].tolist()] == in_order
    assert (order.tiles[len(in_order):, 1] * tile_n >= 2 ** 29).all()  # past every sequence: no work
    chunks = visits.masked_end.numel() // heads_k
    ctas = []  # (entries of its share, its list, its share, whether the list is split), in grid order
    for x in range(max_pieces * heads_k * order.tiles.shape[0]):
        piece, n = x % max_pieces, x // max_pieces
        head, entry = n % heads_k, n // heads_k
        if entry >= len(in_order):
            continue
        b, n_block = in_order[entry]
        at = head * chunks + int(visits.chunk_base[b]) + n_block
        start, end, shares = int(visits.offsets[at]), int(visits.offsets[at + 1]), int(visits.pieces[at])
        share = -(-(end - start) // shares)
        first = min(start + piece * share, end)
        last = min(first + share, end)
        if piece == 0 or first < last:
            ctas.append((range(first, last), at, piece, shares > 1, b, head))
    assert any(c[3] for c in ctas) and any(not c[3] for c in ctas)
    dq_turn = torch.zeros_like(order.dq_turns)
    dkv_turn = torch.zeros_like(order.dkv_turns)
    added = {}  # query tile -> the lists that added into it, in order

    def steps(entries, at, piece, split, b, head):
        tile0 = dq_layout.first_tile(int(cu[b]) * g, b, tile_m)
        for i in entries:
            sem = (0, head, tile0 + int(visits.tiles[i]))
            turn = int(order.turns[i])
            yield lambda: int(dq_turn[sem]) == turn
            added.setdefault(sem, []).append(at)
            dq_turn[sem] = turn + 1
        if split:
            for wg in range(2):
                yield lambda: int(dkv_turn[at * 2 + wg]) == piece
                added.setdefault(("dkv", at, wg), []).append(piece)
                dkv_turn[at * 2 + wg] = piece + 1

    rng = random.Random(residents)
    waiting = [steps(*c) for c in ctas]
    running = []  # (steps, the wait before its next step)
    while waiting or running:
        while waiting and len(running) < residents:
            it = waiting.pop(0)
            running.append([it, next(it, None)])
        ready = [r for r in running if r[1] is None or r[1]()]
        assert ready, "every running CTA waits: a deadlock"
        r = rng.choice(ready)
        r[1] = next(r[0], None) if r[1] is not None else None
        if r[1] is None:
            running.remove(r)
    for key, lists in added.items():
        if key[0] == "dkv":
            assert lists == list(range(len(lists)))
        else:  # K/V tiles ascending within the sequence: lists of one head ascending
            assert lists == sorted(lists) and len(set(lists)) == len(lists)
    entries = int(visits.offsets[-1])
    assert sum(len(v) for k, v in added.items() if k[0] != "dkv") == entries
