"""fmha.flash_attn (FlashAttention's API on fmha), on the CPU: FlashAttention-4's signatures and
return values, its bottom-right masks and window convention, varlen layouts (cu_seqlens,
seqused, dense sides), gradients, the copies FlashAttention makes of strided inputs, an error for
every feature fmha refuses, and the harness that runs FlashAttention's own tests
(lab/fa_tests). Paged and cached calls: test_flash_attn_kvcache.py. Outputs are compared with
the naive fp64 attention of tests/naive.py."""

import inspect

import pytest
import torch

from fmha.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
from naive import naive_sequence

pytest_plugins = ["pytester"]  # the harness test runs pytest on a stand-in FlashAttention

F32 = torch.float32
TOL = 2e-5  # fp32 inputs: the reference computes in fp32


def _randn(*shape, seed, dtype=F32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def fa_mask(causal=False, window=(None, None)):
    """FlashAttention-4's mask as tests/naive.py's predicate (written from FA4's interface, not
    from fmha.flash_attn): two negative sides mean no window, causal sets the right side to 0,
    everything bottom-right."""
    left, right = window
    if left is not None and right is not None and left < 0 and right < 0:
        left, right = None, None
    if causal:
        right = 0
    return {"kind": "window", "left": left, "right": right, "bottom_right": True}


def naive_dense(q, k, v, mask, **kw):
    """(O (B, S_q, H, D_v), LSE (B, H, S_q)) in fp64."""
    outs = [naive_sequence(q[b], k[b], v[b], mask, **kw) for b in range(q.shape[0])]
    return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])


def assert_close(actual, expected, tol=TOL):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


def kept_keys(fn, sq, sk, **kwargs):
    """The (S_q, S_k) keep matrix a call computes, read off its output: equal scores (q = 0) and
    one-hot values (v[j] = e_j) make O[i, j] > 0 exactly for the keys row i keeps."""
    q = torch.zeros(1, sq, 1, 16)
    k = torch.zeros(1, sk, 1, 16)
    v = torch.eye(sk).reshape(1, sk, 1, sk)
    out, _ = fn(q, k, v, **kwargs)
    return (out[0, :, 0] > 0).int()


# ---------------------------------------------------------------------------------------------
# signatures: FlashAttention-4 (4.0.0b36) and FlashAttention-3, positions and defaults


FA4_FUNC = ["q", "k", "v", ("qv", None), ("gather_kv_indices", None), ("softmax_scale", None), ("causal", False),
            ("window_size", (None, None)), ("learnable_sink", None), ("softcap", 0.0), ("num_splits", 1),
            ("pack_gqa", None), ("deterministic", False), ("score_mod", None), ("score_mod_bwd", None),
            ("mask_mod", None), ("aux_tensors", None), ("aux_scalars", None), ("block_sparse_tensors", None),
            ("block_sparse_tensors_bwd", None), ("return_lse", False), ("gather_bwd_recompute_p", False),
            ("gather_bwd_token_chunk", None)]
FA4_VARLEN = ["q", "k", "v", ("qv", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None), ("max_seqlen_q", None),
              ("max_seqlen_k", None), ("min_seqlen_k", None), ("seqused_q", None), ("seqused_k", None),
              ("gather_kv_indices", None), ("page_table", None), ("softmax_scale", None), ("causal", False),
              ("window_size", (None, None)), ("learnable_sink", None), ("softcap", 0.0), ("num_splits", 1),
              ("pack_gqa", None), ("deterministic", False), ("score_mod", None), ("score_mod_bwd", None),
              ("mask_mod", None), ("block_sparse_tensors", None), ("aux_tensors", None), ("aux_scalars", None),
              ("return_lse", False), ("scheduler_metadata", None), ("seqlen_k_per_split", None),
              ("disable_scheduler_metadata", False), ("gather_bwd_recompute_p", False),
              ("gather_bwd_token_chunk", None)]
FA3_KVCACHE = ["q", "k_cache", "v_cache", ("k", None), ("v", None), ("qv", None), ("rotary_cos", None),
               ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None), ("cache_leftpad", None),
               ("page_table", None), ("cu_seqlens_q", None), ("cu_seqlens_k_new", None), ("max_seqlen_q", None),
               ("rotary_seqlens", None), ("q_descale", None), ("k_descale", None), ("v_descale", None),
               ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("attention_chunk", 0),
               ("softcap", 0.0), ("rotary_interleaved", True), ("scheduler_metadata", None), ("num_splits", 0),
               ("pack_gqa", None), ("sm_margin", 0), ("return_softmax_lse", False)]


@pytest.mark.parametrize("fn, expected", [(flash_attn_func, FA4_FUNC), (flash_attn_varlen_func, FA4_VARLEN),
                                          (flash_attn_with_kvcache, FA3_KVCACHE)])
def test_signature_matches_flash_attention(fn, expected):
    params = list(inspect.signature(fn).parameters.values())
    got = [p.name if p.default is inspect.Parameter.empty else (p.name, p.default) for p in params]
    assert got == expected
    assert all(p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)


# ---------------------------------------------------------------------------------------------
# masks: bottom-right alignment and FlashAttention-4's window convention


def test_causal_is_bottom_right_both_ways():
    # FlashAttention's own examples (its flash_attn_with_kvcache docstring)
    assert kept_keys(flash_attn_func, 2, 5, causal=True).tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert kept_keys(flash_attn_func, 5, 2, causal=True).tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]


@pytest.mark.parametrize("window, causal, expected", [
    ((None, None), False, [[1, 1, 1, 1]] * 3),
    ((-1, -1), False, [[1, 1, 1, 1]] * 3),          # FlashAttention-2's "no window"
    ((-3, -1), False, [[1, 1, 1, 1]] * 3),          # any two negatives: no window
    ((1, 0), False, [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]),
    ((None, -1), False, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]),  # a negative side is a band offset
    ((-1, None), False, [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]),
    ((-1, 0), False, [[0, 0, 0, 0]] * 3),           # one negative side: taken literally (an empty band)
    ((None, -1), True, [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]),   # causal replaces the right side
    ((0, 5), True, [[0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]),
])
def test_window_convention(window, causal, expected):
    assert kept_keys(flash_attn_func, 3, 4, window_size=window, causal=causal).tolist() == expected


def test_window_accepts_lists_and_rejects_non_ints():
    assert kept_keys(flash_attn_func, 3, 4, window_size=[1, 0]).tolist() == [[1, 1, 0, 0], [0, 1, 1, 0],
                                                                             [0, 0, 1, 1]]
    q = _randn(1, 3, 1, 16, seed=0)
    with pytest.raises(ValueError, match="window_size left"):
        flash_attn_func(q, q, q, window_size=(1.5, 0))
    with pytest.raises(ValueError, match="pair"):
        flash_attn_func(q, q, q, window_size=(1, 2, 3))


# ---------------------------------------------------------------------------------------------
# flash_attn_func against the naive attention


@pytest.mark.parametrize("sq, sk", [(5, 9), (9, 5), (1, 7), (6, 1)])
@pytest.mark.parametrize("causal, window", [(False, (None, None)), (True, (None, None)), (False, (3, 1)),
                                            (False, (None, -2)), (False, (-1, 3)), (True, (2, None)),
                                            (False, (4, None))])
def test_func_matches_naive(sq, sk, causal, window):
    q, k, v = (_randn(2, s, 2, 16, seed=i) for i, s in enumerate((sq, sk, sk)))
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    ref_o, ref_l = naive_dense(q, k, v, fa_mask(causal, window))
    assert_close(out, ref_o)
    assert lse.shape == (2, 2, sq) and lse.dtype == torch.float32
    assert_close(lse, ref_l)


@pytest.mark.parametrize("hq, hk", [(4, 4), (4, 2), (4, 1)])
def test_func_gqa_mqa_softcap_sink_scale(hq, hk):
    q = _randn(2, 7, hq, 32, seed=0, scale=3.0)
    k, v = _randn(2, 11, hk, 32, seed=1), _randn(2, 11, hk, 16, seed=2)  # D_v != D
    sink = _randn(hq, seed=3)
    out, lse = flash_attn_func(q, k, v, causal=True, softcap=5.0, learnable_sink=sink, softmax_scale=0.3,
                               return_lse=True)
    ref_o, ref_l = naive_dense(q, k, v, fa_mask(True), softcap=5.0, sinks=sink, softmax_scale=0.3)
    assert_close(out, ref_o)
    assert_close(lse, ref_l)


def test_lse_is_natural_log_of_the_scaled_scores():
    q, k, v = _randn(1, 4, 2, 16, seed=0), _randn(1, 6, 2, 16, seed=1), _randn(1, 6, 2, 16, seed=2)
    _, lse = flash_attn_func(q, k, v, softmax_scale=0.5, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) * 0.5
    assert_close(lse, torch.logsumexp(scores, dim=-1))


def test_rows_that_keep_no_key():
    q, k = _randn(1, 6, 2, 16, seed=0), _randn(1, 2, 2, 16, seed=1)
    out, lse = flash_attn_func(q, k, k, causal=True, return_lse=True)
    assert torch.equal(out[0, :4], torch.zeros_like(out[0, :4]))
    assert torch.isneginf(lse[0, :, :4]).all() and torch.isfinite(lse[0, :, 4:]).all()
    sink = torch.tensor([0.5, -1.0])
    out, lse = flash_attn_func(q, k, k, causal=True, learnable_sink=sink, return_lse=True)
    assert torch.equal(out[0, :4], torch.zeros_like(out[0, :4]))
    assert torch.equal(lse[0, :, :4], sink[:, None].expand(2, 4))


def test_empty_keys_and_empty_queries():
    q = _randn(2, 3, 2, 16, seed=0)
    empty = torch.empty(2, 0, 2, 16)
    out, lse = flash_attn_func(q, empty, empty, causal=True, return_lse=True)
    assert torch.equal(out, torch.zeros_like(q)) and torch.isneginf(lse).all()
    out, lse = flash_attn_func(torch.empty(2, 0, 2, 16), q, q, return_lse=True)
    assert out.shape == (2, 0, 2, 16) and lse.shape == (2, 2, 0)


def test_bf16_and_returned_lse_policy():
    q, k, v = (_randn(2, 8, 2, 64, seed=i, dtype=torch.bfloat16) for i in range(3))
    out, lse = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16 and lse is None  # no grad, no return_lse: FA4 returns None
    ref_o, _ = naive_dense(q, k, v, fa_mask(True))
    assert_close(out, ref_o, tol=2e-2)
    q.requires_grad_(True)
    out, lse = flash_attn_func(q, k, v, causal=True)
    assert lse is not None and not lse.requires_grad  # computed for the backward, not differentiable
    out, lse = flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert lse.requires_grad


def test_hints_do_not_change_the_result():
    q, k, v = (_randn(2, 9, 4, 16, seed=i) for i in range(3))
    base, _ = flash_attn_func(q, k, v, causal=True)
    hinted, _ = flash_attn_func(q, k, v, causal=True, num_splits=3, pack_gqa=True, deterministic=True)
    assert torch.equal(base, hinted)
    cu = torch.tensor([0, 9, 18], dtype=torch.int32)
    flat = [t.reshape(18, 4, 16) for t in (q, k, v)]
    out, _ = flash_attn_varlen_func(*flat, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=64, max_seqlen_k=64,
                                    min_seqlen_k=9, causal=True, num_splits=0, pack_gqa=False,
                                    scheduler_metadata=object(), seqlen_k_per_split=4,
                                    disable_scheduler_metadata=True)
    assert torch.equal(out.reshape(2, 9, 4, 16), base)


# ---------------------------------------------------------------------------------------------
# gradients


def _grads_of(outputs, inputs, cotangents):
    return torch.autograd.grad(outputs, inputs, cotangents)


@pytest.mark.parametrize("causal, window, sq, sk", [(True, (None, None), 5, 8), (False, (2, -1), 7, 4)])
def test_func_gradients_with_sink_and_lse(causal, window, sq, sk):
    q = _randn(2, sq, 4, 16, seed=0).requires_grad_()
    k, v = _randn(2, sk, 2, 16, seed=1).requires_grad_(), _randn(2, sk, 2, 16, seed=2).requires_grad_()
    sink = _randn(4, seed=3).requires_grad_()
    out, lse = flash_attn_func(q, k, v, causal=causal, window_size=window, learnable_sink=sink, softcap=4.0,
                               return_lse=True)
    do, dlse = _randn(*out.shape, seed=4), _randn(*lse.shape, seed=5)
    grads = _grads_of((out, lse), (q, k, v, sink), (do, dlse))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v, sink)]
    ref_o, ref_l = naive_dense(*leaves[:3], fa_mask(causal, window), softcap=4.0, sinks=leaves[3])
    finite = torch.isfinite(ref_l)
    ref_grads = _grads_of((ref_o, ref_l[finite]), leaves, (do.double(), dlse.double()[finite]))
    assert grads[3].dtype == sink.dtype
    for g, r in zip(grads, ref_grads):
        assert_close(g, r, tol=1e-4)


def test_unused_lse_gradient_is_ignored():
    q, k, v = (_randn(1, 6, 2, 16, seed=i).requires_grad_() for i in range(3))
    do = _randn(1, 6, 2, 16, seed=9)
    out1, _ = flash_attn_func(q, k, v, causal=True)
    out2, lse2 = flash_attn_func(q, k, v, causal=True, return_lse=True)
    g1 = _grads_of(out1, (q, k, v), do)
    g2 = _grads_of(out2, (q, k, v), do)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    _, lse3 = flash_attn_func(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = _grads_of(lse3.sum(), (q, k, v), None)  # only the LSE: V gets exactly zero
    assert torch.equal(dv, torch.zeros_like(dv)) and dq.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# varlen


def _pack(lengths, heads, dim, seed, extra_rows=0):
    """(packed (T + extra, H, D) tensor, int32 cu_seqlens, per-sequence list of views)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    t = _randn(cu[-1] + extra_rows, heads, dim, seed=seed)
    return t, torch.tensor(cu, dtype=torch.int32), [t[cu[b]:cu[b + 1]] for b in range(len(lengths))]


LENS_Q = [3, 0, 1, 6, 2]
LENS_K = [5, 4, 0, 1, 7]


@pytest.mark.parametrize("causal, window", [(True, (None, None)), (False, (None, None)), (False, (1, 2)),
                                            (False, (-1, None))])
def test_varlen_matches_naive_per_sequence(causal, window):
    q, cu_q, qs = _pack(LENS_Q, 4, 16, seed=0)
    k, cu_k, ks = _pack(LENS_K, 2, 16, seed=1)
    v, _, vs = _pack(LENS_K, 2, 16, seed=2)
    sink = _randn(4, seed=3)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                                      max_seqlen_k=7, causal=causal, window_size=window, learnable_sink=sink,
                                      return_lse=True)
    assert out.shape == (sum(LENS_Q), 4, 16) and lse.shape == (4, sum(LENS_Q))
    mask = fa_mask(causal, window)
    for b in range(len(LENS_Q)):
        ref_o, ref_l = naive_sequence(qs[b], ks[b], vs[b], mask, sinks=sink)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        assert_close(out[rows], ref_o)
        assert_close(lse[:, rows], ref_l)


def test_varlen_rows_past_the_last_offset():
    q, cu_q, qs = _pack([2, 3], 2, 16, seed=0, extra_rows=2)
    k, cu_k, ks = _pack([4, 1], 2, 16, seed=1, extra_rows=3)
    q[-2:] = float("nan")  # rows FlashAttention allows past cu_seqlens[-1]: never read
    k[-3:] = float("nan")
    out, lse = flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
    assert out.shape == (7, 2, 16) and lse.shape == (2, 7)
    for b in range(2):
        ref_o, _ = naive_sequence(qs[b], ks[b], ks[b], fa_mask(True))
        assert_close(out[int(cu_q[b]):int(cu_q[b + 1])], ref_o)
    assert torch.equal(out[5:], torch.zeros_like(out[5:])) and torch.isneginf(lse[:, 5:]).all()


@pytest.mark.parametrize("q_layout", ["packed", "dense"])
@pytest.mark.parametrize("k_layout", ["packed", "dense", "seqused_dense", "seqused_packed"])
def test_varlen_mixed_layouts(q_layout, k_layout):
    """Every query layout with every key layout gives the naive attention of the rows used."""
    batch, sq, sk = 3, 5, 6
    lq, lk = [5, 1, 3], [6, 0, 2]
    q_dense, k_dense, v_dense = _randn(batch, sq, 2, 16, seed=0), _randn(batch, sk, 1, 16, seed=1), \
        _randn(batch, sk, 1, 16, seed=2)
    kw = {}
    if q_layout == "packed":
        q = torch.cat([q_dense[b, :lq[b]] for b in range(batch)])
        kw["cu_seqlens_q"] = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    else:
        q = q_dense.clone()
        for b in range(batch):
            q[b, lq[b]:] = float("nan")  # rows seqused_q leaves out: never read
        kw["seqused_q"] = torch.tensor(lq, dtype=torch.int32)
    if k_layout in ("packed", "seqused_packed"):
        # seqused_packed: each sequence has two rows more than it uses, NaN, never read
        pad = 2 if k_layout == "seqused_packed" else 0
        rows = [torch.cat([t[b, :lk[b]], torch.full((pad, 1, 16), float("nan"))]) for b in range(batch)
                for t in (k_dense,)]
        vrows = [torch.cat([v_dense[b, :lk[b]], torch.full((pad, 1, 16), float("nan"))]) for b in range(batch)]
        k, v = torch.cat(rows), torch.cat(vrows)
        cu = [0]
        for n in lk:
            cu.append(cu[-1] + n + pad)
        kw["cu_seqlens_k"] = torch.tensor(cu, dtype=torch.int32)
        if pad:
            kw["seqused_k"] = torch.tensor(lk, dtype=torch.int32)
    elif k_layout == "seqused_dense":
        k, v = k_dense.clone(), v_dense.clone()
        for b in range(batch):
            k[b, lk[b]:] = float("nan")
            v[b, lk[b]:] = float("nan")
        kw["seqused_k"] = torch.tensor(lk, dtype=torch.int32)
    else:
        k, v = k_dense, v_dense
        lk = [sk] * batch
    out, lse = flash_attn_varlen_func(q, k, v, causal=True, return_lse=True, **kw)
    for b in range(batch):
        ref_o, ref_l = naive_sequence(q_dense[b, :lq[b]], k_dense[b, :lk[b]], v_dense[b, :lk[b]], fa_mask(True))
        if q_layout == "packed":
            rows = slice(sum(lq[:b]), sum(lq[:b + 1]))
            assert_close(out[rows], ref_o)
            assert_close(lse[:, rows], ref_l)
        else:
            assert out.shape == (batch, sq, 2, 16) and lse.shape == (batch, 2, sq)
            assert_close(out[b, :lq[b]], ref_o)
            assert_close(lse[b, :, :lq[b]], ref_l)
            assert torch.equal(out[b, lq[b]:], torch.zeros_like(out[b, lq[b]:]))


def test_varlen_gradients_through_seqused_gather():
    batch, sq, sk = 2, 4, 5
    lq, lk = [4, 2], [3, 5]
    q = _randn(batch, sq, 2, 16, seed=0).requires_grad_()
    k, v = _randn(batch, sk, 2, 16, seed=1).requires_grad_(), _randn(batch, sk, 2, 16, seed=2).requires_grad_()
    out, _ = flash_attn_varlen_func(q, k, v, seqused_q=torch.tensor(lq, dtype=torch.int32),
                                    seqused_k=torch.tensor(lk, dtype=torch.int32), causal=True)
    do = _randn(*out.shape, seed=3)
    dq, dk, dv = _grads_of(out, (q, k, v), do)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    loss = 0
    for b in range(batch):
        o, _ = naive_sequence(leaves[0][b, :lq[b]], leaves[1][b, :lk[b]], leaves[2][b, :lk[b]], fa_mask(True))
        loss = loss + (o * do[b, :lq[b]].double()).sum()
    ref = torch.autograd.grad(loss, leaves)
    for g, r in zip((dq, dk, dv), ref):
        assert_close(g, r, tol=1e-4)
    assert torch.equal(dq[1, 2:], torch.zeros_like(dq[1, 2:])) and torch.equal(dk[0, 3:], torch.zeros_like(dk[0, 3:]))


def test_varlen_gradients_packed():
    q, cu_q, _ = _pack([3, 0, 4], 2, 16, seed=0)
    k, cu_k, _ = _pack([2, 3, 5], 1, 16, seed=1)
    q, k = q.requires_grad_(), k.requires_grad_()
    sink = _randn(2, seed=2, dtype=torch.bfloat16).requires_grad_()
    out, lse = flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True,
                                      learnable_sink=sink, return_lse=True)
    do, dlse = _randn(*out.shape, seed=3), _randn(*lse.shape, seed=4)
    grads = _grads_of((out, lse), (q, k, sink), (do, dlse))
    ql, kl, sl = (t.detach().double().requires_grad_() for t in (q, k, sink))
    loss = 0
    for b, (qa, qb, ka, kb) in enumerate([(0, 3, 0, 2), (3, 3, 2, 5), (3, 7, 5, 10)]):
        o, l = naive_sequence(ql[qa:qb], kl[ka:kb], kl[ka:kb], fa_mask(True), sinks=sl)
        loss = loss + (o * do[qa:qb].double()).sum() + (l * dlse[:, qa:qb].double()).sum()
    ref = torch.autograd.grad(loss, (ql, kl, sl))
    assert grads[2].dtype == torch.bfloat16
    for g, r, tol in zip(grads, ref, (1e-4, 1e-4, 2e-2)):
        assert_close(g, r, tol=tol)


# ---------------------------------------------------------------------------------------------
# strided inputs: copied as FlashAttention copies them


def test_strided_inputs_are_copied_and_differentiable():
    leaves = [_randn(2, 6, 2, 17, seed=i).requires_grad_() for i in range(3)]
    views = [t[..., :16] for t in leaves]  # rows 17 floats apart: not 16-byte aligned
    out, _ = flash_attn_func(*views, causal=True)
    ref, _ = flash_attn_func(*(t.detach().contiguous() for t in views), causal=True)
    assert torch.equal(out, ref)
    out.sum().backward()
    assert all(t.grad is not None and torch.equal(t.grad[..., 16], torch.zeros_like(t.grad[..., 16]))
               for t in leaves)
    # a view at an odd offset (contiguous, misaligned pointer) and a head dim that is not contiguous
    flat = _randn(2 * 6 * 2 * 16 + 1, seed=5)
    shifted = flat[1:].view(2, 6, 2, 16)
    transposed = _randn(2, 6, 16, 2, seed=6).transpose(-1, -2)
    out, _ = flash_attn_func(shifted, transposed, transposed)
    ref_o, _ = naive_dense(shifted, transposed, transposed, fa_mask())
    assert_close(out, ref_o)
    # BHSD memory seen as BSHD needs no copy and gives the same result
    bhsd = _randn(2, 2, 6, 16, seed=7)
    out, _ = flash_attn_func(bhsd.transpose(1, 2), bhsd.transpose(1, 2), bhsd.transpose(1, 2))
    ref, _ = flash_attn_func(*(bhsd.transpose(1, 2).contiguous(),) * 3)
    assert torch.equal(out, ref)


# ---------------------------------------------------------------------------------------------
# what fmha refuses, and bad input


def _qkv():
    return _randn(1, 4, 2, 16, seed=0), _randn(1, 4, 2, 16, seed=1), _randn(1, 4, 2, 16, seed=2)


REFUSED_FA4 = ["qv", "gather_kv_indices", "score_mod", "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars",
               "block_sparse_tensors"]


@pytest.mark.parametrize("name", REFUSED_FA4 + ["block_sparse_tensors_bwd"])
def test_func_refuses_features_fmha_lacks(name):
    q, k, v = _qkv()
    value = q if name in ("qv", "gather_kv_indices") else (lambda *a: None) if "mod" in name else [q]
    with pytest.raises(NotImplementedError, match=f"does not support {name} "):
        flash_attn_func(q, k, v, **{name: value})


@pytest.mark.parametrize("name", REFUSED_FA4)
def test_varlen_refuses_features_fmha_lacks(name):
    q, k, v = (t[0] for t in _qkv())
    cu = torch.tensor([0, 4], dtype=torch.int32)
    value = q if name in ("qv", "gather_kv_indices") else (lambda *a: None) if "mod" in name else [q]
    with pytest.raises(NotImplementedError, match=f"does not support {name} "):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **{name: value})


@pytest.mark.parametrize("name, value", [("qv", "t"), ("rotary_cos", "t"), ("rotary_sin", "t"),
                                         ("rotary_seqlens", "i"), ("cache_batch_idx", "i"),
                                         ("cache_leftpad", "i"), ("q_descale", "t"), ("k_descale", "t"),
                                         ("v_descale", "t"), ("attention_chunk", 8)])
def test_kvcache_refuses_features_fmha_lacks(name, value):
    q, k, v = _qkv()
    value = {"t": q, "i": torch.zeros(1, dtype=torch.int32)}.get(value, value)
    with pytest.raises(NotImplementedError, match=f"does not support {name} "):
        flash_attn_with_kvcache(q, k, v, **{name: value})


def test_sparse_mla_backward_options_without_gather_are_errors():
    q, k, v = _qkv()
    for kw in ({"gather_bwd_recompute_p": True}, {"gather_bwd_token_chunk": 64}):
        with pytest.raises(ValueError, match="gather_kv_indices"):
            flash_attn_func(q, k, v, **kw)


def test_bad_varlen_arguments():
    q, k, v = (t[0] for t in _qkv())
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu.long(), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="with cu_seqlens_q, q must be packed"):
        flash_attn_varlen_func(q[None], k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="without cu_seqlens_q, q must be"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 5 but sequence 0 has 4 keys"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                               seqused_k=torch.tensor([5], dtype=torch.int32))
    with pytest.raises(ValueError, match="page_table cannot be combined with cu_seqlens_k"):
        flash_attn_varlen_func(q, k[None], v[None], cu_seqlens_q=cu, cu_seqlens_k=cu,
                               page_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k has 3 entries"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be nondecreasing"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=torch.tensor([0, 4, 2], dtype=torch.int32),
                               cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32))


def test_bad_learnable_sink():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="learnable_sink must be float16, bfloat16 or float32"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"shape \(2,\)"):
        flash_attn_func(q, k, v, learnable_sink=torch.zeros(3))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        flash_attn_func(None, k, v)


# ---------------------------------------------------------------------------------------------
# lab/fa_tests/fa_plugin.py: the harness that runs FlashAttention's tests against fmha.flash_attn

FAKE_FLASH_ATTN = '''
def flash_attn_func(*args, **kwargs):
    raise AssertionError("FlashAttention itself was called: the harness did not swap it")
'''

FAKE_TESTS = '''
import pytest
import torch
from flash_attn.cute import flash_attn_func

@pytest.mark.parametrize("s", range(10))
@pytest.mark.parametrize("causal", [False, True])
def test_grid(s, causal):
    q = torch.randn(1, 3, 1, 16)
    out, lse = flash_attn_func(q, q, q, causal=causal)
    assert out.shape == q.shape and lse is None

def test_refused():
    q = torch.randn(1, 3, 1, 16)
    flash_attn_func(q, q, q, score_mod=lambda *args: None)

def test_skips_itself():
    pytest.skip("not on this GPU")

def test_fails():
    assert False, "boom"

@pytest.mark.parametrize("x", [1, 2])
def test_xfails(x):
    pytest.xfail("known")

def test_flash_attn_invalid_head_dim():
    raise AssertionError("not applicable: never runs")
'''


# in-process runs re-import their plugins each time: keep to the harness (hypothesis's alone costs seconds)
QUIET = ("--assert=plain", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-p", "no:cacheprovider")


def test_harness_swaps_samples_and_reports(pytester):
    import json

    pytester.makepyfile(**{"flash_attn/__init__": "", "flash_attn/cute/__init__": FAKE_FLASH_ATTN,
                           "test_fake": FAKE_TESTS})
    pytester.syspathinsert()
    report = pytester.path / "report"
    result = pytester.runpytest(*QUIET, "-p", "lab.fa_tests.fa_plugin", "--fa-sample", "8", "--fa-seed", "3",
                                "--fa-report", str(report), "test_fake.py")
    result.assert_outcomes(passed=3, failed=1, skipped=2, xfailed=2, deselected=6)
    summary = json.loads((report / "fa_report.json").read_text())
    rows = {fid.rsplit("::", 1)[-1]: r for fid, r in summary["per_function"].items()}
    assert {n: (r["collected"], r["sampled"]) for n, r in rows.items()} == {
        "test_grid": (20, 3), "test_refused": (1, 1), "test_skips_itself": (1, 1), "test_fails": (1, 1),
        "test_xfails": (2, 2)}
    assert rows["test_grid"]["passed"] == 3 and rows["test_refused"]["skipped_refused"] == 1
    assert rows["test_skips_itself"]["skipped_by_test"] == 1 and rows["test_fails"]["failed"] == 1
    assert summary["collected"] == 26 and summary["sampled"] == 8
    assert list(summary["not_applicable"]) == ["test_fake.py::test_flash_attn_invalid_head_dim"]
    assert summary["patched"] == ["test_fake.flash_attn_func"]
    assert any(r.startswith("fmha refuses: fmha.flash_attn does not support score_mod")
               for r in summary["skip_reasons"])
    assert "| test_grid | 20 | 3 | 3 | 0 |" in (report / "fa_report.md").read_text()

    def drawn(seed):
        run = pytester.runpytest(*QUIET, "-p", "lab.fa_tests.fa_plugin", "--fa-sample", "8", "--fa-seed", str(seed),
                                 "--collect-only", "-q", "test_fake.py")
        return sorted(line for line in run.outlines if "test_grid[" in line)

    assert drawn(3) == drawn(3) != drawn(4)  # a seed draws the same cases every time
    assert len(drawn(3)) == 3
    # past the deadline nothing more starts, and the report still comes
    late = pytester.runpytest(*QUIET, "-p", "lab.fa_tests.fa_plugin", "--fa-sample", "8", "--fa-deadline", "1e-9",
                              "--fa-report", str(report), "test_fake.py")
    late.assert_outcomes(skipped=8, deselected=6)
    assert json.loads((report / "fa_report.json").read_text())["totals"]["not_run"] == 8
