"""A brute-force NSA, written from docs/nsa.md's definition without fmha.nsa's code: one query
token and one head at a time, in fp64, with Python lists for the key sets. The other NSA tests
compare fmha.nsa (its fast path and its reference) with it; the tests here check it on cases
small enough to work out by hand."""

import math

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The NSA tests run many tiny ops: one intra-op thread keeps them from spin-waiting (100x
    slower on a shared 2-core machine); the setting is restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def seq_slices(lens):
    out, start = [], 0
    for n in lens:
        out.append(slice(start, start + n))
        start += n
    return out


def cu_of(lens, device="cpu"):
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.long).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def n_compressed(n, l, d):
    return max(0, (n - l) // d + 1)


def naive_pool(x, lens, l, d):
    """Packed (T_c, H, D): compressed block i of each sequence is the mean of tokens [i*d, i*d+l)."""
    rows = []
    for sl in seq_slices(lens):
        xs = x[sl].double()
        for i in range(n_compressed(sl.stop - sl.start, l, d)):
            rows.append(sum(xs[i * d + r] for r in range(l)) / l)
    return torch.stack(rows) if rows else x.new_zeros((0,) + tuple(x.shape[1:]), dtype=torch.float64)


def _attend(qv, keys, values, scale):
    """One query vector against lists of key/value vectors: (o, lse); nothing -> (0, -inf)."""
    if not keys:
        return torch.zeros_like(values[0]) if values else None, -math.inf
    s = torch.stack([qv @ kv for kv in keys]) * scale
    lse = torch.logsumexp(s, 0)
    p = torch.exp(s - lse)
    return sum(pi * vi for pi, vi in zip(p, values)), lse.item()


def _per_query(q, v_dim, lens, group, keys_of, scale):
    """o (T, H_q, D_v), lse (H_q, T) from ``keys_of(b, t, h_kv) -> (key rows, value rows)``."""
    T, hq = q.shape[0], q.shape[1]
    o = torch.zeros(T, hq, v_dim, dtype=torch.float64)
    lse = torch.full((hq, T), -math.inf, dtype=torch.float64)
    for b, sl in enumerate(seq_slices(lens)):
        for t in range(sl.stop - sl.start):
            for h in range(hq):
                keys, values = keys_of(b, t, h // group)
                if keys:
                    o[sl.start + t, h], lse[h, sl.start + t] = _attend(q[sl.start + t, h].double(), keys, values,
                                                                       scale)
    return o, lse


def naive_compression(q, k_cmp, v_cmp, lens, l, d, scale):
    group = q.shape[1] // k_cmp.shape[1]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n_compressed(n, l, d))

    def keys_of(b, t, h):
        visible = [starts[b] + i for i in range(starts[b + 1] - starts[b]) if i * d + l - 1 <= t]
        return [k_cmp[i, h].double() for i in visible], [v_cmp[i, h].double() for i in visible]

    return _per_query(q, v_cmp.shape[-1], lens, group, keys_of, scale)


def naive_window(q, k, v, lens, w, scale):
    group = q.shape[1] // k.shape[1]
    starts = [sl.start for sl in seq_slices(lens)]

    def keys_of(b, t, h):
        rows = [starts[b] + s for s in range(max(0, t - w + 1), t + 1)]
        return [k[r, h].double() for r in rows], [v[r, h].double() for r in rows]

    return _per_query(q, v.shape[-1], lens, group, keys_of, scale)


def naive_selection(q, k, v, selected, lens, lsel, scale):
    group = q.shape[1] // k.shape[1]
    starts = [sl.start for sl in seq_slices(lens)]

    def keys_of(b, t, h):
        positions = set()
        for j in selected[starts[b] + t, h].tolist():
            if j >= 0:
                positions.update(s for s in range(j * lsel, (j + 1) * lsel) if s <= t)
        rows = [starts[b] + s for s in sorted(positions)]
        return [k[r, h].double() for r in rows], [v[r, h].double() for r in rows]

    return _per_query(q, v.shape[-1], lens, group, keys_of, scale)


def naive_block_scores(q, k_cmp, lens, l, d, lsel, scale):
    """{(packed t, h_kv): [score of selection block j for j in the sequence's blocks]}."""
    hk = k_cmp.shape[1]
    group = q.shape[1] // hk
    out, c0 = {}, 0
    for sl in seq_slices(lens):
        n = sl.stop - sl.start
        nc, ns = n_compressed(n, l, d), (n + lsel - 1) // lsel
        for t in range(n):
            visible = [i for i in range(nc) if i * d + l - 1 <= t]
            for h in range(hk):
                importance = [0.0] * nc
                for g in range(h * group, (h + 1) * group):
                    if not visible:
                        continue
                    s = torch.stack([q[sl.start + t, g].double() @ k_cmp[c0 + i, h].double() for i in visible]) * scale
                    for i, p in zip(visible, torch.softmax(s, 0).tolist()):
                        importance[i] += p
                out[sl.start + t, h] = [sum(importance[i] for i in range(nc)
                                            if i * d < (j + 1) * lsel and i * d + l > j * lsel) for j in range(ns)]
        c0 += nc
    return out


def naive_topk(q, k_cmp, lens, l, d, lsel, n_sel, scale):
    """int (T, H_k, n): forced current, previous, first block (in that order), then the best
    scores, lower index first on a tie, among blocks starting at or before t; ascending, -1 pad."""
    scores = naive_block_scores(q, k_cmp, lens, l, d, lsel, scale)
    out = torch.full((q.shape[0], k_cmp.shape[1], n_sel), -1, dtype=torch.int32)
    for b, sl in enumerate(seq_slices(lens)):
        for t in range(sl.stop - sl.start):
            cur = t // lsel
            for h in range(k_cmp.shape[1]):
                picked = []
                for j in (cur, cur - 1, 0):
                    if j >= 0 and j not in picked and len(picked) < n_sel:
                        picked.append(j)
                sc = scores[sl.start + t, h]
                rest = sorted((j for j in range(cur + 1) if j not in picked), key=lambda j: (-sc[j], j))
                picked += rest[:n_sel - len(picked)]
                picked.sort()
                out[sl.start + t, h, :len(picked)] = torch.tensor(picked, dtype=torch.int32)
    return out


def naive_nsa(q, k, v, gates, lens, l, d, lsel, n_sel, w, scale, selected=None):
    """(o, selected): the gated sum of the three branches, mean pooling."""
    k_cmp, v_cmp = naive_pool(k, lens, l, d), naive_pool(v, lens, l, d)
    o_cmp, _ = naive_compression(q, k_cmp, v_cmp, lens, l, d, scale)
    if selected is None:
        selected = naive_topk(q, k_cmp, lens, l, d, lsel, n_sel, scale)
    o_slc, _ = naive_selection(q, k, v, selected, lens, lsel, scale)
    o_win, _ = naive_window(q, k, v, lens, w, scale)
    g_cmp, g_slc, g_win = (g.double()[..., None] for g in gates)
    return g_cmp * o_cmp + g_slc * o_slc + g_win * o_win, selected


# ---- the brute force itself, on cases worked out by hand ----

def test_naive_pool_and_compressed_counts_by_hand():
    x = torch.arange(10, dtype=torch.float64).view(10, 1, 1)
    # one sequence of 10 tokens, l=4, d=2: blocks start at 0, 2, 4, 6 -> means 1.5, 3.5, 5.5, 7.5
    assert naive_pool(x, [10], 4, 2).flatten().tolist() == [1.5, 3.5, 5.5, 7.5]
    assert [n_compressed(n, 4, 2) for n in (0, 3, 4, 5, 6)] == [0, 0, 1, 1, 2]


def test_naive_compression_visibility_by_hand():
    # q = 0: uniform weights over the visible blocks, so o is the mean of their values
    q = torch.zeros(10, 1, 2, dtype=torch.float64)
    kc = torch.zeros(4, 1, 2, dtype=torch.float64)
    vc = torch.arange(8, dtype=torch.float64).view(4, 1, 2)
    o, lse = naive_compression(q, kc, vc, [10], 4, 2, 1.0)
    # block i is visible from t = 2i + 3: t=2 sees none, t=3,4 see block 0, t=9 sees all four
    assert lse[0, 2] == -math.inf and o[2].abs().sum() == 0
    assert o[3, 0].tolist() == [0.0, 1.0] and o[4, 0].tolist() == [0.0, 1.0]
    assert o[9, 0].tolist() == [3.0, 4.0] and lse[0, 9] == math.log(4)


def test_naive_topk_forced_blocks_and_ties_by_hand():
    # q = 0 and equal keys: every visible compressed block weighs the same, so selection blocks
    # tie wherever they overlap as many compressed blocks; the lower index wins
    q = torch.zeros(40, 1, 2, dtype=torch.float64)
    kc = torch.zeros(n_compressed(40, 4, 4), 1, 2, dtype=torch.float64)
    sel = naive_topk(q, kc, [40], 4, 4, 4, 5, 1.0)
    # t=39: current block 9, previous 8, first 0, then blocks 1 and 2 (ties broken low)
    assert sel[39, 0].tolist() == [0, 1, 2, 8, 9]
    # t=5: blocks 0 and 1 exist; padded
    assert sel[5, 0].tolist() == [0, 1, -1, -1, -1]
