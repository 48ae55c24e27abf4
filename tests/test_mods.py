"""Programmable attention on the host: score_mod / mask_mod / block masks in the reference against
naive attention and PyTorch FlexAttention, the dual-number derivative, block-mask building and
conversion, the kernels' tile lists, and the errors (no GPU needed)."""

import math

import pytest
import torch

import fmha
from fmha import mods as M
from fmha.block_mask import FULL, PARTIAL, SKIPPED, BlockMask



def _alibi(score, b, h, q, kv, aux):
    return score + aux[0][h] * (kv - q)


def _causal(b, h, q, kv):
    return q >= kv


def _naive_mod(q, k, v, score_fn=None, keep_fn=None, scale=None):
    """(B, S, H, D) float64 attention with the mods applied by hand on full index grids."""
    b_, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (scale or 1 / math.sqrt(d))
    bi = torch.arange(b_).view(-1, 1, 1, 1)
    hi = torch.arange(hq).view(1, -1, 1, 1)
    qi = torch.arange(sq).view(1, 1, -1, 1)
    ki = torch.arange(sk).view(1, 1, 1, -1)
    if score_fn is not None:
        s = score_fn(s, bi, hi, qi, ki)
    if keep_fn is not None:
        s = s.masked_fill(~keep_fn(bi, hi, qi, ki).expand(s.shape), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(b, sq, sk, hq, hk, d, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(b, s, h, d, generator=g, dtype=torch.float64) for s, h in ((sq, hq), (sk, hk), (sk, hk))]
    return [t.requires_grad_() for t in ts] if grad else ts


@pytest.mark.parametrize("hq,hk", [(4, 4), (6, 2)])
def test_score_and_mask_mod_forward_backward_match_naive(hq, hk):
    slopes = torch.tensor([2 ** (-8 * (i + 1) / hq) for i in range(hq)], dtype=torch.float32)
    q, k, v = _inputs(2, 37, 53, hq, hk, 16, grad=True)
    o = fmha.attention(q, k, v, score_mod=_alibi, mask_mod=lambda b, h, qi, kv: (kv - qi) <= 7, aux=(slopes,))
    qn, kn, vn = (t.detach().clone().requires_grad_() for t in (q, k, v))
    on = _naive_mod(qn, kn, vn, lambda s, b, h, qi, kv: s + slopes[h] * (kv - qi),
                    lambda b, h, qi, kv: (kv - qi) <= 7)
    torch.testing.assert_close(o, on, atol=1e-12, rtol=0)
    dout = torch.randn_like(o)
    o.backward(dout)
    on.backward(dout)
    for a, b in zip((q, k, v), (qn, kn, vn)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0)


def test_varlen_mods_see_positions_within_each_sequence():
    lens = [5, 0, 1, 23]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(int(cu[-1]), 3, 16, generator=g, dtype=torch.float64) for _ in range(3))
    seq_bias = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=torch.float64)

    def score(s, b, h, qi, kv, aux):
        return s + aux[0][b] * (qi - kv)

    o = fmha.attention_varlen(q, k, v, cu, cu, score_mod=score, mask_mod=_causal, aux=(seq_bias,))
    for b, (s0, s1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if s1 == s0:
            continue
        on = _naive_mod(q[None, s0:s1], k[None, s0:s1], v[None, s0:s1],
                        lambda s, bi, h, qi, kv: s + seq_bias[b] * (qi - kv), lambda bi, h, qi, kv: qi >= kv)
        torch.testing.assert_close(o[s0:s1], on[0], atol=1e-12, rtol=0)


def test_mask_mod_equal_to_builtin_causal_and_window():
    q, k, v = _inputs(1, 40, 40, 2, 2, 16)
    ref = fmha.attention(q, k, v, causal=True, window_size=(5, None))
    o = fmha.attention(q, k, v, mask_mod=lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= 5))
    torch.testing.assert_close(o, ref, atol=1e-13, rtol=0)
    # both together intersect
    o2 = fmha.attention(q, k, v, causal=True, mask_mod=lambda b, h, qi, kv: qi - kv <= 5)
    torch.testing.assert_close(o2, ref, atol=1e-13, rtol=0)


def test_softcap_as_score_mod_matches_builtin_softcap_with_gradients():
    q, k, v = _inputs(1, 30, 30, 2, 2, 16, grad=True)
    o = fmha.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: 3 * M.tanh(s / 3), causal=True)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o2 = fmha.attention(q2, k2, v2, softcap=3.0, causal=True)
    torch.testing.assert_close(o, o2, atol=1e-13, rtol=0)
    o.sum().backward()
    o2.sum().backward()
    for a, b in zip((q, k, v), (q2, k2, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fn", [
    lambda s, b, h, q, kv: s * 2.0 + 1.0,
    lambda s, b, h, q, kv: 4 * M.tanh(s / 4),
    lambda s, b, h, q, kv: M.where(q >= kv, s, s * 0.5),
    lambda s, b, h, q, kv: M.exp(s / 8) - M.abs(s) / (1.0 + s * s),
    lambda s, b, h, q, kv: M.maximum(s, -1.0) + M.minimum(s * s, 2.0) - M.log(1.0 + M.exp(s)),
    lambda s, b, h, q, kv: 3.0 - s,
])
def test_dual_number_derivative_matches_autograd(fn):
    s = torch.randn(200, dtype=torch.float64, requires_grad=True)
    qi, kv = torch.arange(200) % 13, torch.arange(200) % 7
    y = fn(s, 0, 0, qi, kv)
    (auto,) = torch.autograd.grad(y.sum(), s)
    dual = fn(M.Dual(s.detach(), 1.0), 0, 0, qi, kv)
    torch.testing.assert_close(torch.as_tensor(dual.value).expand(200), y.detach(), atol=1e-14, rtol=0)
    torch.testing.assert_close(torch.as_tensor(dual.grad, dtype=torch.float64).expand(200), auto, atol=1e-12, rtol=0)


def test_affine_score_mods_have_constant_derivatives():
    """What lets the backward skip the derivative of a bias or ALiBi: it stays a Python number."""
    slopes = torch.ones(4)
    d = _alibi(M.Dual(torch.zeros(3), 1.0), 0, torch.tensor([1]), 3, torch.tensor([5]), (slopes,))
    assert d.grad == 1.0 and isinstance(d.grad, float)
    assert (M.Dual(1.0, 1.0) * 2.0 - 1.0).grad == 2.0


def test_create_block_mask_states_match_brute_force():
    s_q, s_k, blk = 150, 130, 32
    docs = torch.randint(0, 5, (max(s_q, s_k),), generator=torch.Generator().manual_seed(3)).sort().values

    def mask(b, h, qi, kv):
        return (docs[qi] == docs[kv]) & (qi >= kv) | (h == 1) & (kv < 10)

    bm = fmha.create_block_mask(mask, None, 2, s_q, s_k, device="cpu", BLOCK_SIZE=blk)
    qi, kv = torch.arange(s_q).view(-1, 1), torch.arange(s_k).view(1, -1)
    for h in range(2):
        keep = mask(0, torch.tensor(h), qi, kv)
        for i in range(bm.states.shape[2]):
            for j in range(bm.states.shape[3]):
                blk_keep = keep[i * blk:(i + 1) * blk, j * blk:(j + 1) * blk]
                want = FULL if blk_keep.all() else PARTIAL if blk_keep.any() else SKIPPED
                assert int(bm.states[0, h, i, j]) == want, (h, i, j)


def test_tile_states_and_lists_at_other_tile_sizes():
    states = torch.tensor([[FULL, PARTIAL, SKIPPED, SKIPPED],
                           [FULL, FULL, SKIPPED, FULL],
                           [SKIPPED, SKIPPED, SKIPPED, PARTIAL]], dtype=torch.uint8)[None, None]
    bm = BlockMask(states, (64, 64), (192, 250))
    # finer tiles inherit; the last key tile runs past 250 keys: never full
    fine = bm.tile_states(64, 32)[0, 0]
    assert fine[1].tolist() == [FULL, FULL, FULL, FULL, SKIPPED, SKIPPED, FULL, PARTIAL]
    coarse = bm.tile_states(128, 128)[0, 0]
    assert coarse.tolist() == [[PARTIAL, PARTIAL], [SKIPPED, PARTIAL]]
    counts, idx = bm.tile_lists(64, 64)
    assert counts[0, 0].tolist() == [[1, 1], [1, 2], [1, 0]]  # key tile 3 (192..250) is ragged: partial
    assert idx[0, 0, 0, :2].tolist() == [1, 0] and idx[0, 0, 1, :3].tolist() == [3, 0, 1]
    counts_t, idx_t = bm.tile_lists(64, 64, transposed=True)
    assert counts_t[0, 0, 3].tolist() == [2, 0] and idx_t[0, 0, 3, :2].tolist() == [1, 2]


def test_block_mask_honours_full_blocks_without_mask_mod():
    """Full blocks are computed whole (mask_mod not called), as FlexAttention does."""
    q, k, v = _inputs(1, 64, 64, 1, 1, 8)
    states = torch.tensor([[FULL, SKIPPED], [PARTIAL, FULL]], dtype=torch.uint8)[None, None]
    bm = BlockMask(states, (32, 32), (64, 64), mask_mod=_causal)
    o = fmha.attention(q, k, v, block_mask=bm)
    qi, kv = torch.arange(64).view(-1, 1), torch.arange(64).view(1, -1)
    keep = ((qi < 32) & (kv < 32)) | ((qi >= 32) & (kv >= 32)) | ((qi >= 32) & (kv < 32) & (qi >= kv))
    on = _naive_mod(q, k, v, keep_fn=lambda b, h, a, c: keep)
    torch.testing.assert_close(o, on, atol=1e-13, rtol=0)


def test_flex_attention_block_mask_gives_flex_attention_answer():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    b, h, s, d = 2, 3, 200, 16
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for _ in range(3))
    docs = torch.randint(0, 4, (s,), generator=g).sort().values

    def doc_causal(bi, hi, qi, kv):
        return (docs[qi] == docs[kv]) & (qi >= kv)

    def alibi(score, bi, hi, qi, kv):
        return score + (hi + 1) * 0.1 * (kv - qi)

    fbm = flex.create_block_mask(doc_causal, None, None, s, s, device="cpu")
    want = flex.flex_attention(q, k, v, score_mod=alibi, block_mask=fbm)  # no backward on the CPU
    got = fmha.attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=alibi, block_mask=fbm)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=2e-6, rtol=0)
    # converted once, equal states to fmha's own builder
    ours = fmha.create_block_mask(doc_causal, None, None, s, s, device="cpu")
    assert torch.equal(BlockMask.from_flex(fbm).states, ours.states)


def test_captured_tensors_are_rebound_for_the_kernel_and_key_the_cache():
    table = torch.arange(10)

    def make(w):
        return lambda b, h, qi, kv: (table[qi] - kv) <= w

    f1, f2 = M.ModFunction.check(make(3), M.MASK), M.ModFunction.check(make(4), M.MASK)
    assert f1.captured == (("cell", "table"),) and f1.captured_tensors()[0] is table
    assert repr(f1) != repr(f2)  # the window is baked into the compiled kernel
    replaced = f1.bound([torch.arange(10) * 0])
    assert bool(replaced(0, 0, 5, 2)) and not bool(f1.fn(0, 0, 9, 2))


def test_signature_keys_each_tensors_unit_innermost_stride():
    """A kernel compiled for unit-stride mod tensors (which lets neighbouring positions share an
    address) is not reused for a strided one: the signature, which selects the kernel, differs."""
    from fmha.options import parse

    def bias(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][kv_idx]

    opts = parse(score_mod=bias)
    table = torch.randn(64, 2)
    unit, strided = M.call_mods(opts, (table[:, 0].contiguous(),)), M.call_mods(opts, (table[:, 0],))
    assert unit.signature().tensors == ((torch.float32, 1, True),)
    assert strided.signature().tensors == ((torch.float32, 1, False),)
    assert unit.signature() != strided.signature()


def test_mods_errors_say_what_to_change():
    q, k, v = _inputs(1, 8, 8, 2, 2, 16)
    with pytest.raises(TypeError, match="score_mod takes"):
        fmha.attention(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match="mask_mod must be a Python function"):
        fmha.attention(q, k, v, mask_mod=3)
    with pytest.raises(ValueError, match="softcap and score_mod"):
        fmha.attention(q, k, v, score_mod=lambda s, b, h, qi, kv: s, softcap=2.0)
    with pytest.raises(ValueError, match="aux= is read by score_mod or mask_mod"):
        fmha.attention(q, k, v, aux=torch.ones(2))
    with pytest.raises(ValueError, match="takes an aux argument"):
        fmha.attention(q, k, v, score_mod=_alibi)
    with pytest.raises(TypeError, match="uint8"):
        fmha.attention(q, k, v, score_mod=_alibi, aux=(torch.ones(2, dtype=torch.bool),))
    bm = fmha.create_block_mask(_causal, None, None, 16, 8, device="cpu", BLOCK_SIZE=8)
    with pytest.raises(ValueError, match="build it with those lengths"):
        fmha.attention(q, k, v, block_mask=bm)
    with pytest.raises(TypeError, match="block_mask must be"):
        fmha.attention(q, k, v, block_mask=torch.ones(1, 1, 1, 1))
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError):
        fmha.attention_varlen(q[0], k[0], v[0], cu, cu, block_mask=bm)


def test_mods_through_the_custom_op():
    """The custom op (what meta tensors, dispatch modes and torch.compile reach) carries the mods:
    same values and gradients as the eager autograd function (torch.compile: the next test)."""
    from torch.utils.flop_counter import FlopCounterMode

    slopes = torch.tensor([0.5, 0.25], dtype=torch.float32)
    q, k, v = _inputs(1, 20, 20, 2, 2, 16, grad=True)

    def f(q, k, v):
        return fmha.attention(q, k, v, score_mod=_alibi, mask_mod=_causal, aux=(slopes,))

    eager = f(q, k, v)
    with FlopCounterMode(display=False):  # a dispatch mode: the call takes the custom op
        through_op = f(q, k, v)
    torch.testing.assert_close(through_op, eager, atol=0, rtol=0)
    through_op.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    eager.sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=0, rtol=0)


def test_fused_attention_serves_the_mods_it_is_built_with():
    """``FusedAttention`` takes score_mod / mask_mod / aux / block_mask at construction and runs
    them on every execution (it once dropped them silently)."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 37, 4, 32, generator=g) for _ in range(3))
    slopes = torch.rand(4, generator=g)

    def alibi(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][h] * (kv_idx - q_idx)

    bm = fmha.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 37, 37, device="cpu", BLOCK_SIZE=16)
    out = torch.full_like(q, float("nan"))
    fa = fmha.FusedAttention(q, k, v, out, score_mod=alibi, aux=(slopes,), block_mask=bm)
    fa.execute(q, k, v, out)
    want = fmha.attention(q, k, v, score_mod=alibi, aux=(slopes,), causal=True)
    torch.testing.assert_close(out, want)
    out.fill_(float("nan"))
    fa.execute(q, k, v, out, check=False)
    torch.testing.assert_close(out, want)
    assert not torch.allclose(want, fmha.attention(q, k, v, causal=True))


def test_mods_under_torch_compile_fullgraph_forward_and_backward():
    """``torch.compile(fullgraph=True)`` traces calls with a score mod reading ``aux``, a mask
    mod reading a captured tensor and a block mask, on their first call (the mod ids exist before
    the graph runs); values and gradients equal the eager calls', and two closures over different
    windows stay apart."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 45, 4, 32, generator=g) for _ in range(3))
    slopes = torch.rand(4, generator=g)
    docs = torch.tensor([0] * 20 + [1] * 25, dtype=torch.int32)

    def alibi(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][h] * (kv_idx - q_idx)

    def same_doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    bm = fmha.create_block_mask(same_doc, None, None, 45, 45, device="cpu", BLOCK_SIZE=16)

    def call(q, k, v):
        return fmha.attention(q, k, v, score_mod=alibi, aux=(slopes,), block_mask=bm)

    def window(w):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= w) & (kv_idx <= q_idx)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.compile(call, fullgraph=True)(*leaves)
    want = call(*eager_leaves)
    torch.testing.assert_close(got, want)
    dout = torch.randn_like(want)
    got.backward(dout)
    want.backward(dout)
    for a, b in zip(leaves, eager_leaves):
        torch.testing.assert_close(a.grad, b.grad)
    compiled = torch.compile(lambda q, mod: fmha.attention(q, k, v, mask_mod=mod), fullgraph=True)
    for w in (3, 10):
        torch.testing.assert_close(compiled(q, window(w)), fmha.attention(q, k, v, mask_mod=window(w)))


def test_kept_triples_with_mods_counts_what_the_reference_keeps():
    """The CLI's FLOP count with a mask mod: two documents (30 and 50 rows), causal, 3 heads."""
    from fmha.options import parse
    from fmha.reference import kept_triples_with_mods

    docs = torch.tensor([0] * 30 + [1] * 50)

    def same_doc(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]

    mods = M.call_mods(parse(mask_mod=same_doc))
    assert kept_triples_with_mods(mods, parse(causal=True).mask, [80, 80], [80, 80], 3, "cpu") == \
        2 * 3 * (30 * 31 // 2 + 50 * 51 // 2)
    bm = fmha.create_block_mask(same_doc, None, None, 80, 80, device="cpu", BLOCK_SIZE=16)
    assert kept_triples_with_mods(M.call_mods(parse(), None, bm), parse().mask, [80], [80], 2, "cpu") == \
        2 * (30 * 30 + 50 * 50)


def test_a_reused_plan_tells_an_aux_tensor_from_a_block_masks_states():
    """Two calls whose mod tensors have the same metadata, one an aux tensor, the other a block
    mask's states, get different memo keys (a kernel plan for one would misread the other)."""
    from fmha import dispatch
    from fmha.options import parse

    bm = fmha.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 32, 32, device="cpu", BLOCK_SIZE=16)

    def causal(b, h, q_idx, kv_idx, aux):
        return q_idx >= kv_idx

    opts = parse(mask_mod=causal)
    with_aux = M.call_mods(opts, (torch.zeros_like(bm.states),))
    with_mask = M.call_mods(opts, None, bm)
    q = torch.randn(1, 32, 2, 16)

    def key(mods):
        return dispatch.memo_key((q, q, q) + dispatch._mod_tensors(mods), (opts, dispatch._mods_layout(mods)))

    assert [t.shape for t in dispatch._mod_tensors(with_aux)] == [t.shape for t in dispatch._mod_tensors(with_mask)]
    assert key(with_aux) != key(with_mask)


@pytest.mark.parametrize("layout", ["dense", "varlen", "block_mask"])
def test_aux_tensors_get_their_gradients(layout):
    """A learnable ALiBi slope per head and a relative-position bias table passed as ``aux``:
    their gradients (and q's, k's, v's) equal plain autograd through the same formula; an aux
    tensor read only by the mask mod gets zeros (a mask has no derivative); a captured tensor
    that requires grad is an error that says to pass it as aux."""
    g = torch.Generator().manual_seed(7)
    lens = [13, 0, 21] if layout == "varlen" else [25, 25]
    total = sum(lens)
    slopes = torch.rand(4, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(4, 8, generator=g, dtype=torch.float64).requires_grad_()

    def biased(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][h] * (kv_idx - q_idx) + aux[1][h, M.minimum(M.abs(q_idx - kv_idx), 7)]

    def causal(b, h, q_idx, kv_idx, aux):
        return q_idx >= kv_idx

    q, k, v = (torch.randn(total, n, 16, generator=g, dtype=torch.float64) for n in (4, 2, 2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if layout == "varlen":
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        out = fmha.attention_varlen(*leaves, cu, cu, score_mod=biased, mask_mod=causal, aux=(slopes, table))
    else:
        kw = dict(mask_mod=causal)
        if layout == "block_mask":
            kw = dict(block_mask=fmha.create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, 25, 25,
                                                        device="cpu", BLOCK_SIZE=8))
        out = fmha.attention(*(t.view(2, 25, *t.shape[1:]) for t in leaves), score_mod=biased, aux=(slopes, table),
                             **kw).reshape(total, 4, 16)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dout)

    want_slopes, want_table = slopes.detach().clone().requires_grad_(), table.detach().clone().requires_grad_()
    naive = [t.clone().requires_grad_() for t in (q, k, v)]
    pieces, start = [], 0
    for n in lens:
        qs, ks, vs = (t[start:start + n] for t in naive)
        ks, vs = (t.repeat_interleave(2, dim=1) for t in (ks, vs))
        s = torch.einsum("qhd,khd->hqk", qs, ks) / 4
        i, j, h = torch.arange(n).view(1, -1, 1), torch.arange(n).view(1, 1, -1), torch.arange(4).view(-1, 1, 1)
        s = s + want_slopes[h] * (j - i) + want_table[h, (i - j).abs().clamp(max=7)]
        s = s.masked_fill(j > i, float("-inf"))
        pieces.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vs))
        start += n
    torch.cat(pieces).backward(dout)
    torch.testing.assert_close(slopes.grad, want_slopes.grad)
    torch.testing.assert_close(table.grad, want_table.grad)
    for a, b in zip(leaves, naive):
        torch.testing.assert_close(a.grad, b.grad)

    # read by the mask mod only: no derivative
    gate = torch.ones(3, dtype=torch.float64, requires_grad=True)
    qd = q[:25].view(1, 25, 4, 16).clone().requires_grad_()
    fmha.attention(qd, qd[..., :2, :], qd[..., :2, :], mask_mod=causal, aux=(gate,)).sum().backward()
    assert torch.equal(gate.grad, torch.zeros(3, dtype=torch.float64)) and qd.grad is not None

    def captured(score, b, h, q_idx, kv_idx):
        return score + slopes[h]

    with pytest.raises(ValueError, match="captures 'slopes', a tensor that requires grad.*pass it as aux"):
        fmha.attention(qd, qd[..., :2, :], qd[..., :2, :], score_mod=captured)
    with torch.no_grad():
        fmha.attention(qd, qd[..., :2, :], qd[..., :2, :], score_mod=captured)



def test_learnable_aux_under_torch_compile_says_to_run_eagerly():
    slopes = torch.rand(2, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx, aux):
        return score + aux[0][h] * (kv_idx - q_idx)

    q = torch.randn(1, 9, 2, 16, requires_grad=True)
    f = torch.compile(lambda q, s: fmha.attention(q, q, q, score_mod=alibi, aux=(s,)), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="differentiated eagerly only"):
        f(q, slopes)
    f(q, slopes.detach())  # detached: traced as before
