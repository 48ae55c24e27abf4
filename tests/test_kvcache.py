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
    for page_size in (1, 5, 16, 32):
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
    big = kp.new_zeros((kp.shape[0], 257) + kp.shape[2:])
    with pytest.raises(ValueError, match="page size .* from 1 to 256 keys, got 257"):
        fmha.attention_with_kvcache(q, big, big, lens, block_table=table)
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


# ---- mixed batches: packed query rows over the cache (``cu_seqlens_q``)

ROWS = [3, 0, 40, 45]  # query rows per sequence (LENS keys each): decodes, an empty one, chunks


def _packed_q(rows, pad=0, seed=5):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(rows) + pad, HQ, D, generator=g).to(DT)
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32)
    return q, cu


@pytest.mark.parametrize("kwargs,mask", [
    ({}, {"kind": "window", "left": None, "right": 0, "bottom_right": True}),
    ({"causal": False}, {"kind": "none"}),
    ({"window_size": (7, 0)}, {"kind": "window", "left": 7, "right": 0, "bottom_right": True}),
    ({"causal": False, "window_size": (None, -2)}, {"kind": "window", "left": None, "right": -2,
                                                     "bottom_right": True}),
])
def test_a_mixed_batch_matches_the_naive_attention_per_sequence(kwargs, mask):
    """Each sequence's rows attend to its own cached keys, bottom-right aligned (rows before the
    first key see nothing: sequence 2 has 40 rows and 37 keys, sequence 0 three rows and none);
    padding rows past cu_seqlens_q[-1] are not written; paged and dense caches agree."""
    q, cu = _packed_q(ROWS, pad=2)
    k, v = _dense()
    lens = torch.tensor(LENS, dtype=torch.int32)
    sinks = torch.randn(HQ)
    out = torch.full(q.shape, 7.0, dtype=DT)
    o, lse = fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, return_lse=True, out=out, sinks=sinks,
                                         **kwargs)
    assert o is out and lse.shape == (HQ, q.shape[0]) and torch.all(out[-2:] == 7)
    kp, vp, table = _paged(k, v, 32)
    o_paged, lse_paged = fmha.attention_varlen(q, kp, vp, cu, seqused_k=lens, block_table=table, return_lse=True,
                                               sinks=sinks, **({"causal": True} | kwargs))
    real = sum(ROWS)
    assert torch.equal(o_paged[:real], o[:real]) and torch.equal(lse_paged[:, :real], lse[:, :real])
    for b, (n_q, n_k) in enumerate(zip(ROWS, LENS)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want_o, want_lse = naive_sequence(q[rows].double(), k[b, :n_k].double(), v[b, :n_k].double(), mask,
                                          sinks=sinks)
        assert torch.allclose(o[rows].double(), want_o, atol=TOL)
        assert torch.allclose(lse[:, rows].double(), want_lse, atol=1e-4)


def test_attention_varlen_over_a_cache_refuses_what_it_cannot_do():
    q, cu = _packed_q(ROWS)
    k, v = _dense()
    kp, vp, table = _paged(k, v, 16)
    lens = torch.tensor(LENS, dtype=torch.int32)
    call = fmha.attention_varlen
    with pytest.raises(ValueError, match="counted by seqused_k, not cu_seqlens_k"):
        call(q, kp, vp, cu, cu, seqused_k=lens, block_table=table)
    with pytest.raises(ValueError, match="block_table needs seqused_k"):
        call(q, kp, vp, cu, block_table=table)
    with pytest.raises(ValueError, match="bottom-right aligned"):
        call(q, kp, vp, cu, seqused_k=lens, block_table=table, mask_align="top_left")
    with pytest.raises(ValueError, match="score_mod: not served over a KV cache"):
        call(q, kp, vp, cu, seqused_k=lens, block_table=table, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(TypeError, match="unknown option"):
        call(q, kp, vp, cu, seqused_k=lens, block_table=table, casual=True)
    with pytest.raises(ValueError, match="not differentiable"):
        call(q.clone().requires_grad_(), kp, vp, cu, seqused_k=lens, block_table=table)
    with pytest.raises(TypeError, match="needs cu_seqlens_k"):
        call(q, k, v, cu)
    with pytest.raises(ValueError, match="k_new/v_new are appended for dense query batches"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, k_new=k[:, :1].clone(), v_new=v[:, :1].clone())
    with pytest.raises(ValueError, match="num_splits"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, num_splits=4)
    with pytest.raises(ValueError, match="max_seqlen_q is for packed queries"):
        fmha.attention_with_kvcache(q[None], k[:1], v[:1], lens[:1], max_seqlen_q=3)
    with pytest.raises(ValueError, match=r"q must be 3-D \(T_q, H_q, D\)"):
        fmha.attention_with_kvcache(q[None], k, v, lens, cu_seqlens_q=cu)
    with pytest.raises(ValueError, match="cache_seqlens has 4 entries for a batch of 3"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu[:4])
    with pytest.raises(ValueError, match="more than max_seqlen_q = 10"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, max_seqlen_q=10)
    backwards = cu.clone()
    backwards[2] = 0
    with pytest.raises(ValueError, match="cu_seqlens_q must rise from 0"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=backwards)
    with pytest.raises(ValueError, match=r"out must be a \(88, 4, 32\)"):
        fmha.attention_with_kvcache(q, k, v, lens, cu_seqlens_q=cu, out=torch.empty(B, 3, HQ, D, dtype=DT))


# ---- fp8 caches under a 16-bit query

E4M3 = torch.float8_e4m3fn
SCALE_K, SCALE_V = 0.05, 0.02  # dequantization factors: values = stored x scale


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16])
def test_an_fp8_cache_is_attended_as_its_dequantized_values(q_dtype):
    q = torch.randn(B, 2, HQ, D).to(q_dtype)
    k, v = _dense()
    k8, v8 = (k.float() / SCALE_K).to(E4M3), (v.float() / SCALE_V).to(E4M3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    o, lse = fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=SCALE_K, scale_v=SCALE_V, return_lse=True)
    assert o.dtype == q_dtype and lse.dtype == torch.float32
    mask = {"kind": "window", "left": None, "right": 0, "bottom_right": True}
    want_o, want_lse = _want(q, k8.double() * SCALE_K, v8.double() * SCALE_V, LENS, mask)
    assert torch.allclose(o.double(), want_o, atol=TOL)
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=1e-4)
    kp, vp, table = _paged(k, v, 16)  # quantized page by page: the same values
    paged = fmha.attention_with_kvcache(q, (kp.float() / SCALE_K).to(E4M3), (vp.float() / SCALE_V).to(E4M3), lens,
                                        block_table=table, scale_k=SCALE_K, scale_v=SCALE_V)
    assert torch.equal(paged, o)


def test_new_keys_are_quantized_into_an_fp8_cache_with_its_scales():
    """16-bit k_new/v_new go in divided by the cache's scales, rounded to nearest and saturated at
    e4m3's 448 (NaN stays NaN); fp8 ones go in as they are."""
    s_new = 2
    q = torch.randn(B, s_new, HQ, D).to(DT)
    k, v = _dense()
    k8, v8 = (k.float() / SCALE_K).to(E4M3), (v.float() / SCALE_V).to(E4M3)
    k_new, v_new = torch.randn(B, s_new, HK, D).to(DT), torch.randn(B, s_new, HK, D).to(DT)
    k_new[0, 0, 0, :3] = torch.tensor([1e4, -1e4, float("nan")])  # beyond e4m3 after the scale
    lens = torch.tensor(LENS, dtype=torch.int32)
    fmha.attention_with_kvcache(q, k8, v8, lens, k_new=k_new, v_new=v_new, scale_k=SCALE_K, scale_v=SCALE_V)
    for b, n in enumerate(LENS):
        want_k = (k_new[b].float() / SCALE_K).to(E4M3)
        assert torch.equal(k8[b, n:n + s_new].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(v8[b, n:n + s_new].view(torch.uint8), (v_new[b].float() / SCALE_V).to(E4M3).view(torch.uint8))
    assert k8[0, 0, 0, :2].float().tolist() == [448.0, -448.0] and k8[0, 0, 0, 2].float().isnan()
    fp8_new = (k_new.float() / SCALE_K).to(E4M3)
    k8b = (k.float() / SCALE_K).to(E4M3)
    fmha.attention_with_kvcache(q, k8b, v8.clone(), lens, k_new=fp8_new, v_new=(v_new.float() / SCALE_V).to(E4M3),
                                scale_k=SCALE_K, scale_v=SCALE_V)
    assert torch.equal(k8b[1, 1:1 + s_new].view(torch.uint8), fp8_new[1].view(torch.uint8))


def test_cache_and_query_dtypes_that_do_not_go_together_say_so():
    q = torch.randn(B, 1, HQ, D).to(DT)
    k, v = _dense()
    k8, v8 = k.to(E4M3), v.to(E4M3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    with pytest.raises(TypeError, match="k_cache and v_cache must share a dtype"):
        fmha.attention_with_kvcache(q, k8, v, lens)
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fmha.attention_with_kvcache(q.to(E4M3), k, v, lens)  # an fp8 query needs an fp8 cache
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        fmha.attention_with_kvcache(q.float(), k8, v8, lens)  # fp8 caches are for 16-bit queries
    with pytest.raises(ValueError, match="k_new must be .* in bfloat16 or float8_e4m3fn"):
        fmha.attention_with_kvcache(q, k8, v8, lens, k_new=k[:, :1].half(), v_new=v[:, :1].half())


def test_the_decode_kernel_is_planned_with_the_cache_converted():
    """Where the Hopper kernel serves it (nothing here runs it): the decode configuration with
    the cache's dtype, a staging ring beside the K/V ring, and no reason to refuse."""
    from fmha.kernels.hopper.config import why_unsupported_decode
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner
    from fmha.kvcache import decode_problem

    q = torch.randn(2, 1, 32, 128).to(DT)
    k8 = torch.zeros(2, 1000, 8, 128, dtype=E4M3)
    problem, _ = decode_problem(q, k8, k8, torch.tensor([5, 999], dtype=torch.int32), scale_k=0.5)
    assert problem.kv_dtype == E4M3 and problem.dtype == DT
    assert why_unsupported_decode(problem) == []
    cfg = HopperDecodeRunner(problem).plan(problem, 132).cfg
    assert cfg.kv_converted and cfg.kv_dtype == E4M3 and cfg.dtype == DT
    assert cfg.kv_stages >= 2 and cfg.kv_staging_stages >= 2
    plain, _ = decode_problem(q, k8.to(DT), k8.to(DT), torch.tensor([5, 999], dtype=torch.int32))
    assert not HopperDecodeRunner(plain).plan(plain, 132).cfg.kv_converted


def test_a_one_row_gqa_decode_hands_the_kernel_views_of_out_and_lse(monkeypatch):
    """With one query row, the packed rows of a GQA group are views of the caller's out and lse:
    the kernel writes them in place and nothing is unpacked after it (with four rows they are a
    buffer apart, unpacked after). The launch is recorded, not run (no GPU here)."""
    from fmha.kernels.hopper import decode_runner
    from fmha.kernels.hopper.forward_runner import ForwardArgs
    from fmha.kvcache import decode_problem

    monkeypatch.setattr(decode_runner, "sm_count", lambda device: 132)
    monkeypatch.setattr(fmha.device_errors, "flag", lambda device: torch.zeros(1, dtype=torch.int32))
    k = torch.zeros(2, 1000, 8, 128, dtype=DT)
    lens = torch.tensor([5, 999], dtype=torch.int32)
    for s_q, in_place in ((1, True), (4, False)):
        q = torch.randn(2, s_q, 32, 128).to(DT)
        problem, _ = decode_problem(q, k, k, lens, return_lse=True, num_splits=1)
        runner = decode_runner.HopperDecodeRunner(problem)
        launches = []
        monkeypatch.setattr(runner, "load", lambda cfg, compile_fn: lambda *args: launches.append(ForwardArgs(*args)))
        out, lse = torch.zeros(2, s_q, 32, 128, dtype=DT), torch.zeros(2, 32, s_q)
        runner(problem, q, k, k, lens, None, out, lse)
        (args,) = launches
        assert args.mO.shape == (2, s_q * 4, 8, 128) and args.mLSE.shape == (2, 8, s_q * 4)
        assert (args.mO.data_ptr() == out.data_ptr()) == in_place
        assert (args.mLSE.data_ptr() == lse.data_ptr()) == in_place
        if in_place:  # row j of K/V head h is query head h * 4 + j
            assert args.mO.stride() == (32 * 128, 128, 4 * 128, 1)
            args.mO[1, 3, 5].fill_(7.0)
            assert (out[1, 0, 5 * 4 + 3] == 7.0).all()


def test_fp8_cache_scales_may_be_tensors_per_sequence_and_head():
    """scale_k/scale_v as float32 tensors ((), (H_k,), (B, H_k)): the same answer as dequantizing
    each head by hand; a scalar tensor gives what the float gives; appends divide by their own
    sequence's and head's scale."""
    q = torch.randn(B, 1, HQ, D).to(DT)
    k, v = _dense()
    lens = torch.tensor(LENS, dtype=torch.int32)
    sk = torch.rand(B, HK) * 0.1 + 0.01
    sv = torch.rand(B, HK) * 0.1 + 0.01
    k8 = (k.float() / sk[:, None, :, None]).to(E4M3)
    v8 = (v.float() / sv[:, None, :, None]).to(E4M3)
    o = fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=sk, scale_v=sv)
    mask = {"kind": "window", "left": None, "right": 0, "bottom_right": True}
    want, _ = _want(q, k8.double() * sk[:, None, :, None].double(), v8.double() * sv[:, None, :, None].double(),
                    LENS, mask)
    assert torch.allclose(o.double(), want, atol=TOL)
    by_head = fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=sk[0], scale_v=sv[0])  # (H_k,): row 0's
    want0, _ = _want(q, k8.double() * sk[0, None, None, :, None].double(), v8.double() * sv[0, None, None, :, None].double(),
                     LENS, mask)
    assert torch.allclose(by_head.double(), want0, atol=TOL)
    scalar = fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=torch.tensor(SCALE_K), scale_v=torch.tensor(SCALE_V))
    assert torch.equal(scalar, fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=SCALE_K, scale_v=SCALE_V))
    k_new = torch.randn(B, 1, HK, D).to(DT)
    fmha.attention_with_kvcache(q, k8, v8, lens, k_new=k_new, v_new=k_new, scale_k=sk, scale_v=sv)
    for b, n in enumerate(LENS):
        want_k = (k_new[b].float() / sk[b][None, :, None]).to(E4M3)
        assert torch.equal(k8[b, n:n + 1].view(torch.uint8), want_k.view(torch.uint8))


def test_bad_fp8_cache_scale_tensors_say_what_to_change():
    q = torch.randn(B, 1, HQ, D).to(DT)
    k, v = _dense()
    k8, v8 = k.to(E4M3), v.to(E4M3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    good = torch.ones(HK)
    with pytest.raises(TypeError, match="both floats or both tensors"):
        fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=good, scale_v=1.0)
    with pytest.raises(ValueError, match="shape \\(\\), \\(1,\\), \\(H_k,\\)"):
        fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=torch.ones(3), scale_v=good)
    with pytest.raises(TypeError, match="float32 tensor"):
        fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=good.half(), scale_v=good)
    with pytest.raises(ValueError, match="fp8 cache's dequantization factors"):
        fmha.attention_with_kvcache(q, k, v, lens, scale_k=good, scale_v=good)
    with pytest.raises(ValueError, match="softcap with tensor scales"):
        fmha.attention_with_kvcache(q, k8, v8, lens, scale_k=good, scale_v=good, softcap=30.0)


def test_tensor_scales_plan_a_kernel_that_reads_them():
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner
    from fmha.kvcache import decode_problem

    q = torch.randn(2, 1, 32, 128).to(DT)
    k8 = torch.zeros(2, 1000, 8, 128, dtype=E4M3)
    scale = torch.ones(2, 8)
    problem, scales = decode_problem(q, k8, k8, torch.tensor([5, 999], dtype=torch.int32), scale_k=scale,
                                     scale_v=scale)
    assert problem.kv_scale_tensors and scales["scale_k"] == scales["scale_v"] == 1.0
    cfg = HopperDecodeRunner(problem).plan(problem, 132).cfg
    assert cfg.kv_converted and cfg.kv_scale_tensors


def test_attention_varlen_over_an_fp8_cache_takes_tensor_scales():
    """The engines' spelling (packed queries, seqused_k, block_table) takes the same tensor scales."""
    q, cu = _packed_q(ROWS)
    k, v = _dense()
    sk, sv = torch.rand(HK) * 0.1 + 0.01, torch.rand(HK) * 0.1 + 0.01
    k8, v8 = (k.float() / sk[:, None]).to(E4M3), (v.float() / sv[:, None]).to(E4M3)
    lens = torch.tensor(LENS, dtype=torch.int32)
    got = fmha.attention_varlen(q, k8, v8, cu, seqused_k=lens, causal=True, scale_k=sk, scale_v=sv,
                                max_seqlen_q=max(ROWS))
    want = fmha.attention_with_kvcache(q, k8, v8, lens, cu_seqlens_q=cu, max_seqlen_q=max(ROWS), scale_k=sk,
                                       scale_v=sv)
    assert torch.equal(got, want)


@pytest.mark.parametrize("head_dim,cache_dtype,page_size,served", [
    (128, DT, 1, True), (64, DT, 7, True), (128, E4M3, 1, True), (64, E4M3, 6, True), (64, E4M3, 5, False),
    (32, DT, 3, False), (32, DT, 2, True), (96, DT, 9, False), (96, DT, 48, True), (256, DT, 16, False)])
def test_the_decode_kernel_takes_pages_whose_runs_stay_128_byte_aligned(head_dim, cache_dtype, page_size, served):
    """A paged cache loads each K/V tile in runs of gcd(page, tile) keys, one TMA box per swizzle
    atom column, whose shared memory address must be 128-byte aligned: runs of one key for
    128-byte rows, of two for fp8 or D=96's 64-byte atom columns. A page size that breaks that is
    refused with the multiple to use (the GPU raised a misaligned address for fp8 D=64 pages of
    5); the configuration built for a served one passes its own check."""
    from fmha.kernels.hopper.config import why_unsupported_decode
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner
    from fmha.kvcache import decode_problem

    q = torch.randn(2, 1, 8, head_dim).to(DT)
    k = torch.zeros(2 * 10, page_size, 2, head_dim, dtype=cache_dtype)
    table = torch.arange(20, dtype=torch.int32).view(2, 10)
    problem, _ = decode_problem(q, k, k, torch.tensor([3, 10 * page_size], dtype=torch.int32), block_table=table,
                                **({"scale_k": 0.5} if cache_dtype == E4M3 else {}))
    reasons = why_unsupported_decode(problem)
    assert (reasons == []) == served, reasons
    if served:
        assert HopperDecodeRunner(problem).plan(problem, 132).cfg.page_run >= 1
    elif head_dim != 256:
        assert "use a page size that is a multiple of" in reasons[0]
