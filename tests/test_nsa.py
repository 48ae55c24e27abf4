"""fmha.nsa's branches, its top-k and their composition against the brute force of
test_nsa_naive.py (and the fp64 reference against it too): odd lengths, varlen batches with empty
and length-1 sequences, GQA 1/2/4/16, l = d and l != d geometries, ties, queries that see no
compressed block, selection lists with -1, future and unordered entries."""

import math

import pytest
import torch

import fmha.nsa as nsa
from fmha.nsa import reference as ref
from test_nsa_naive import (cu_of, naive_compression, naive_nsa, naive_pool, naive_selection, naive_topk,
                            naive_window, n_compressed, one_thread)  # noqa: F401 (one_thread: autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore")

LENS = [0, 1, 7, 33, 50]
# (block l, stride d, select_block l', select_count n, window w); n exceeds the three forced
# blocks and the longest sequence has more blocks than n, so the scores decide some slots
GEOMETRIES = {
    "paper_ratios": (4, 2, 8, 4, 16),  # l = 2d, l' = 2l as the paper's 32/16/64
    "l=d": (8, 8, 8, 5, 16),
    "l'_not_multiple_of_d": (8, 4, 6, 5, 9),
    "l=d=l'": (4, 4, 4, 6, 5),
    "l>l'": (8, 2, 3, 6, 7),  # a compressed block spans more than the two forced local blocks
}
GQA = [(2, 2), (4, 2), (4, 1), (16, 1)]


def inputs(lens, hq, hk, d=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(total, hk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(total, hk, dv, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v, cu_of(lens)


def assert_lse_equal(got, want, tol=1e-10):
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "the -inf rows (no key seen) differ"
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin].double(), want[fin], rtol=0, atol=tol)


@pytest.mark.parametrize("lens", [LENS, [37]])
@pytest.mark.parametrize("l,d", [(8, 4), (8, 8), (5, 2), (1, 1)])
def test_mean_pool_packed_and_dense(lens, l, d):
    _, k, _, cu = inputs(lens, 2, 2)
    got, cu_cmp = nsa.mean_pool(k, cu, l, d)
    torch.testing.assert_close(got, naive_pool(k, lens, l, d), rtol=0, atol=1e-12)
    assert cu_cmp.tolist() == cu_of([n_compressed(n, l, d) for n in lens]).tolist()
    assert torch.equal(nsa.compressed_cu_seqlens(cu, l, d), cu_cmp)
    dense, none = nsa.mean_pool(k[:lens[-1]][None].expand(2, -1, -1, -1), None, l, d)
    assert none is None and dense.shape[:2] == (2, n_compressed(lens[-1], l, d))
    torch.testing.assert_close(dense[1], naive_pool(k[:lens[-1]], [lens[-1]], l, d), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.mean_pool_reference(k, cu, l, d), naive_pool(k, lens, l, d), rtol=0, atol=1e-12)


def test_mean_pool_of_sequences_shorter_than_a_block():
    _, k, _, cu = inputs([3, 0, 2], 1, 1)
    got, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    assert got.shape == (0, 1, 8) and cu_cmp.tolist() == [0, 0, 0, 0]
    assert nsa.mean_pool(k[:3][None], None, 4, 2)[0].shape == (1, 0, 1, 8)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("hq,hk", GQA)
def test_compression_branch(geometry, hq, hk):
    l, d = GEOMETRIES[geometry][:2]
    q, k, v, cu = inputs(LENS, hq, hk)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    v_cmp, _ = nsa.mean_pool(v, cu, l, d)
    o, lse = nsa.compression_attention(q, k_cmp, v_cmp, cu, cu_cmp, l, d, softmax_scale=0.4)
    want_o, want_lse = naive_compression(q, k_cmp, v_cmp, LENS, l, d, 0.4)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-10)
    assert_lse_equal(lse, want_lse)
    # queries before the first block's end see nothing: 0 and -inf
    t_none = cu[3].item() + l - 2
    assert torch.isneginf(lse[:, t_none]).all() and (o[t_none] == 0).all()
    assert torch.isfinite(lse[:, t_none + 1]).all()
    ro, rl = ref.compression_attention_reference(q, k_cmp, v_cmp, cu, cu_cmp, l, d, softmax_scale=0.4)
    torch.testing.assert_close(ro, want_o, rtol=0, atol=1e-10)
    assert_lse_equal(rl, want_lse)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("hq,hk", GQA)
def test_select_blocks(geometry, hq, hk):
    l, d, lsel, n, _ = GEOMETRIES[geometry]
    q, k, v, cu = inputs(LENS, hq, hk, seed=1)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)
    got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n)
    want = naive_topk(q, k_cmp, LENS, l, d, lsel, n, 1 / math.sqrt(q.shape[-1]))
    assert got.dtype == torch.int32 and got.shape == (q.shape[0], hk, n)
    assert torch.equal(got, want)
    assert torch.equal(ref.select_blocks_reference(q, k_cmp, cu, cu_cmp, l, d, lsel, n), want)
    # the scores matter: ignoring them (all equal, so the lowest blocks win) picks otherwise
    assert not torch.equal(got, naive_topk(q * 0, k_cmp, LENS, l, d, lsel, n, 1.0))


def test_the_top_k_op_refuses_a_max_seqlen_below_the_longest_sequence():
    """The op's bound shapes its score window: a shorter one would drop later blocks silently."""
    l, d, lsel, n, _ = GEOMETRIES["paper_ratios"]
    q, k, _, cu = inputs(LENS, 4, 2, seed=2)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)

    def op(max_seqlen):
        return torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, 8 ** -0.5, "auto",
                                                max_seqlen)
    want = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n)
    assert torch.equal(op(max(LENS)), want) and torch.equal(op(0), want)
    with pytest.raises(ValueError, match="longer than max_seqlen = 49"):
        op(max(LENS) - 1)


def test_select_blocks_with_max_seqlen_checks_the_offsets_in_the_op():
    """Given ``max_seqlen`` the offsets are not read by ``select_blocks`` but checked by the op (on
    the GPU by the device flag, tests/test_gpu_nsa.py; here on the CPU it raises): the same lists,
    and offsets that disagree with the tensors or each other are refused."""
    l, d, lsel, n, _ = GEOMETRIES["paper_ratios"]
    q, k, _, cu = inputs(LENS, 4, 2, seed=3)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)
    want = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n)
    for bound in (max(LENS), 0, 10 * max(LENS)):
        assert torch.equal(nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, max_seqlen=bound), want)
    bad_cmp = cu_cmp.clone()
    bad_cmp[1] += 1
    with pytest.raises(ValueError, match="cu_seqlens_cmp must be nondecreasing"):
        nsa.select_blocks(q, k_cmp, lse, cu, bad_cmp, l, d, lsel, n, max_seqlen=max(LENS))
    with pytest.raises(ValueError, match=r"cu_seqlens_cmp\[-1\] = \d+ but the tensors have"):
        nsa.select_blocks(q, k_cmp, lse, cu, nsa.compressed_cu_seqlens(cu, l, l), l, d, lsel, n, max_seqlen=max(LENS))
    bad_cu = cu.clone()
    bad_cu[1] = bad_cu[2] + 1
    with pytest.raises(ValueError, match="cu_seqlens must be nondecreasing"):
        nsa.select_blocks(q, k_cmp, lse, bad_cu, cu_cmp, l, d, lsel, n, max_seqlen=max(LENS))
    with pytest.raises(ValueError, match="longer than max_seqlen"):
        nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, max_seqlen=max(LENS) - 1)
    with pytest.raises(TypeError, match="cu_seqlens must be int32, got int64"):
        nsa.select_blocks(q, k_cmp, lse, cu.long(), cu_cmp, l, d, lsel, n, max_seqlen=max(LENS))
    with pytest.raises(ValueError, match="cu_seqlens_cmp must be as long as cu_seqlens"):
        nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp[:-1], l, d, lsel, n, max_seqlen=max(LENS))
    with pytest.raises(ValueError, match="max_seqlen must be at least 0"):
        nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, max_seqlen=-1)


def test_select_blocks_breaks_ties_toward_the_lower_block():
    """q = 0: every visible compressed block weighs the same. With l = d = l' each selection
    block's score is one compressed block's probability, so all visible blocks tie exactly."""
    lens = [41, 9]
    q, k, _, cu = inputs(lens, 4, 2)
    q.zero_()
    l = d = lsel = 4
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)
    got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, 6)
    assert torch.equal(got, naive_topk(q, k_cmp, lens, l, d, lsel, 6, 0.5))
    # t = 40 of the first sequence: forced 10, 9, 0, then the lowest tied 1, 2, 3
    assert got[40].tolist() == [[0, 1, 2, 3, 9, 10]] * 2
    # second sequence, t = 8: blocks 0..2 exist, all taken, then padding
    assert got[41 + 8].tolist() == [[0, 1, 2, -1, -1, -1]] * 2


def test_select_blocks_with_fewer_slots_than_forced_blocks():
    """select_count 1 and 2: the current block first, then the previous one."""
    q, k, _, cu = inputs([40], 2, 1, seed=3)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, 4, 2)
    for n in (1, 2):
        got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, 4, 2, 8, n)
        assert torch.equal(got, naive_topk(q, k_cmp, [40], 4, 2, 8, n, q.shape[-1] ** -0.5))
        t = torch.arange(40)
        assert (got[:, 0].max(-1).values == t // 8).all()  # the current block is always in
    got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, 4, 2, 8, 2)
    assert got[3].tolist() == [[0, -1]] and got[20].tolist() == [[1, 2]]


@pytest.mark.parametrize("chunk_rows", [1, 5, 23, 44])
@pytest.mark.parametrize("geometry", ["paper_ratios", "l>l'"])
def test_select_blocks_in_chunks_across_sequences(geometry, chunk_rows, monkeypatch):
    """Chunks of a few rows that start and end inside sequences and span empty and length-1 ones:
    each chunk's window of compressed keys must still hold every key its rows see; an unknown
    longest length (0: T) picks the same blocks."""
    from fmha.nsa import topk
    l, d, lsel, n, _ = GEOMETRIES[geometry]
    lens = [3, 0, 1, 44, 0, 2, 60]
    q, k, _, cu = inputs(lens, 4, 2, seed=5)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)
    want = naive_topk(q, k_cmp, lens, l, d, lsel, n, q.shape[-1] ** -0.5)
    for longest in (max(lens), 0):
        seen = max(1, n_compressed(longest or sum(lens), l, d))
        slc = -(-(longest or sum(lens)) // lsel)
        monkeypatch.setattr(topk, "CHUNK_BYTES", chunk_rows * q.shape[1] * (seen + slc + 2) * 12)
        got = torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, q.shape[-1] ** -0.5,
                                               "auto", longest)
        assert torch.equal(got, want), (longest, chunk_rows)


def test_select_blocks_reads_nothing_on_the_host():
    """Under fake tensors a host read (tolist, item, a data-dependent shape) raises: the top-k
    shapes follow from the token counts and the longest length alone, so a CUDA graph captures it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from fmha.nsa.topk import _select_blocks_torch
    lens = [19, 0, 1, 44]
    q, k, _, cu = inputs(lens, 4, 2, seed=5)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, 4, 2)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = [mode.from_tensor(t) for t in (q, k_cmp, lse, cu, cu_cmp)]
        out = _select_blocks_torch(*args, 4, 2, 8, 4, 0.3, max(lens))
    assert out.shape == (sum(lens), 2, 4) and out.dtype == torch.int32
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, pytest.raises(Exception):
        mode.from_tensor(cu).tolist()  # the probe: a host read does raise here


def random_selection(lens, hk, n, lsel, seed=0):
    """Lists in any order with -1 slots and blocks in the query's future (they contribute nothing)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length in lens:
        blocks = max(1, (length + lsel - 1) // lsel)
        for _ in range(length):
            for _ in range(hk):
                perm = torch.randperm(blocks, generator=g)[:n].tolist()
                perm += [-1] * (n - len(perm))
                if torch.rand(1, generator=g).item() < 0.3:
                    perm[0] = -1
                rows.append(perm)
    return torch.tensor(rows, dtype=torch.int32).view(sum(lens), hk, n)


@pytest.mark.parametrize("hq,hk", GQA)
@pytest.mark.parametrize("lsel,n", [(16, 3), (5, 4)])
def test_selection_attention(hq, hk, lsel, n):
    q, k, v, cu = inputs(LENS, hq, hk, seed=2)
    sel = random_selection(LENS, hk, n, lsel)
    o, lse = nsa.selection_attention(q, k, v, sel, cu, lsel, softmax_scale=0.3)
    want_o, want_lse = naive_selection(q, k, v, sel, LENS, lsel, 0.3)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-10)
    assert_lse_equal(lse, want_lse)
    ro, rl = ref.selection_attention_reference(q, k, v, sel, cu, lsel, softmax_scale=0.3)
    torch.testing.assert_close(ro, want_o, rtol=0, atol=1e-10)
    assert_lse_equal(rl, want_lse)


def test_selection_attention_in_small_chunks(monkeypatch):
    """The PyTorch path gathers a bounded chunk of queries at a time; chunk edges change nothing."""
    from fmha.nsa import selection

    q, k, v, cu = inputs(LENS, 4, 2, seed=4)
    sel = random_selection(LENS, 2, 3, 8)
    whole = nsa.selection_attention(q, k, v, sel, cu, 8)
    monkeypatch.setattr(selection, "CHUNK_BYTES", 1)
    chunked = nsa.selection_attention(q, k, v, sel, cu, 8)
    for a, b in zip(whole, chunked):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hq,hk", GQA)
@pytest.mark.parametrize("w", [1, 5, 16])
def test_window_branch(hq, hk, w):
    q, k, v, cu = inputs(LENS, hq, hk, seed=5)
    o, lse = nsa.window_attention(q, k, v, cu, w, softmax_scale=0.5)
    want_o, want_lse = naive_window(q, k, v, LENS, w, 0.5)
    torch.testing.assert_close(o, want_o, rtol=0, atol=1e-10)
    assert_lse_equal(lse, want_lse)
    torch.testing.assert_close(ref.window_attention_reference(q, k, v, cu, w, softmax_scale=0.5)[0], want_o,
                               rtol=0, atol=1e-10)


def gates(total, hq, seed=0, batch=None):
    g = torch.Generator().manual_seed(seed)
    shape = (total, hq) if batch is None else (batch, total, hq)
    return tuple(torch.rand(shape, generator=g, dtype=torch.float64) for _ in range(3))


@pytest.mark.parametrize("geometry,hq,hk", [(g, 4, 2) for g in GEOMETRIES] + [("paper_ratios", 16, 1), ("l>l'", 16, 1)])
def test_nsa_attention_packed(geometry, hq, hk):
    l, d, lsel, n, w = GEOMETRIES[geometry]
    q, k, v, cu = inputs(LENS, hq, hk, seed=6)
    gs = gates(q.shape[0], hq)
    kw = dict(block=l, stride=d, select_block=lsel, select_count=n, window=w)
    o, branches = nsa.nsa_attention(q, k, v, *gs, cu_seqlens=cu, return_branches=True, **kw)
    want, want_sel = naive_nsa(q, k, v, gs, LENS, l, d, lsel, n, w, q.shape[-1] ** -0.5)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-10)
    assert torch.equal(branches.selected, want_sel)
    assert branches.cu_seqlens_cmp.tolist() == cu_of([n_compressed(x, l, d) for x in LENS]).tolist()
    r, rb = nsa.nsa_reference(q, k, v, *gs, cu_seqlens=cu, return_branches=True, **kw)
    torch.testing.assert_close(r, want, rtol=0, atol=1e-10)
    for name in ("o_cmp", "o_slc", "o_win"):
        torch.testing.assert_close(getattr(branches, name), getattr(rb, name), rtol=0, atol=1e-10)
    for name in ("lse_cmp", "lse_slc", "lse_win"):
        assert_lse_equal(getattr(branches, name), getattr(rb, name))


def test_nsa_attention_dense_equals_packed_per_sequence():
    l, d, lsel, n, w = GEOMETRIES["paper_ratios"]
    kw = dict(block=l, stride=d, select_block=lsel, select_count=n, window=w)
    q, k, v, _ = inputs([37] * 2, 4, 2, seed=7)
    qd, kd, vd = (t.view(2, 37, *t.shape[1:]) for t in (q, k, v))
    gs = gates(37, 4, batch=2)
    o, br = nsa.nsa_attention(qd, kd, vd, *gs, return_branches=True, **kw)
    assert o.shape == (2, 37, 4, 6) and br.lse_cmp.shape == (2, 4, 37) and br.selected.shape == (2, 37, 2, n)
    assert br.k_cmp.shape == (2, n_compressed(37, l, d), 2, 8) and br.cu_seqlens_cmp is None
    packed = nsa.nsa_attention(q, k, v, *(g.reshape(74, 4) for g in gs), cu_seqlens=cu_of([37, 37]), **kw)
    torch.testing.assert_close(o.reshape(74, 4, 6), packed, rtol=0, atol=1e-12)
    want, _ = naive_nsa(q, k, v, tuple(g.reshape(74, 4) for g in gs), [37, 37], l, d, lsel, n, w, 8 ** -0.5)
    torch.testing.assert_close(o.reshape(74, 4, 6), want, rtol=0, atol=1e-10)
    torch.testing.assert_close(nsa.nsa_reference(qd, kd, vd, *gs, **kw), o, rtol=0, atol=1e-10)


def test_nsa_attention_with_given_selection_and_compressed_kv():
    l, d, lsel, n, w = GEOMETRIES["paper_ratios"]
    q, k, v, cu = inputs(LENS, 4, 2, seed=8)
    gs = gates(q.shape[0], 4, seed=1)
    sel = random_selection(LENS, 2, 4, lsel, seed=1)
    k_cmp = naive_pool(k, LENS, l, d) * 0.5  # any pooling: the branch takes what it is given
    v_cmp = naive_pool(v, LENS, l, d) + 1.0
    o = nsa.nsa_attention(q, k, v, *gs, cu_seqlens=cu, block=l, stride=d, select_block=lsel, window=w,
                          selected=sel.long(), k_cmp=k_cmp, v_cmp=v_cmp)
    scale = 8 ** -0.5
    o_cmp, _ = naive_compression(q, k_cmp, v_cmp, LENS, l, d, scale)
    o_slc, _ = naive_selection(q, k, v, sel, LENS, lsel, scale)
    o_win, _ = naive_window(q, k, v, LENS, w, scale)
    want = gs[0][..., None] * o_cmp + gs[1][..., None] * o_slc + gs[2][..., None] * o_win
    torch.testing.assert_close(o, want, rtol=0, atol=1e-10)
    r = nsa.nsa_reference(q, k, v, *gs, cu_seqlens=cu, block=l, stride=d, select_block=lsel, window=w,
                          selected=sel, k_cmp=k_cmp, v_cmp=v_cmp)
    torch.testing.assert_close(r, want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nsa_attention_in_lower_precision_is_close_to_the_fp64_reference(dtype):
    l, d, lsel, n, w = GEOMETRIES["paper_ratios"]
    kw = dict(block=l, stride=d, select_block=lsel, select_count=n, window=w)
    q, k, v, cu = inputs(LENS, 4, 2, seed=9, dtype=dtype)
    gs = tuple(g.to(dtype) for g in gates(q.shape[0], 4))
    o, br = nsa.nsa_attention(q, k, v, *gs, cu_seqlens=cu, return_branches=True, **kw)
    assert o.dtype == dtype and br.lse_cmp.dtype == torch.float32
    # the reference takes the same selection: near-ties may rank differently in low precision
    want = nsa.nsa_reference(q, k, v, *gs, cu_seqlens=cu, selected=br.selected, **kw)
    err = (o.double() - want).norm() / want.norm()
    assert err < (1e-6 if dtype == torch.float32 else 1e-2)
