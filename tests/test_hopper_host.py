"""Host side of the Hopper kernel, on the CPU: what it supports, its tile and stage choices, and
the fp8 V staging (layout and key order) that the kernel's register layout relies on."""

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.jit import launch  # noqa: E402
from fmha.kernels.common.fp8_order import FP8_KEY_ORDER  # noqa: E402
from fmha.kernels.hopper import config as hc  # noqa: E402
from fmha.kernels.hopper.forward_runner import HopperRunner  # noqa: E402
from fmha.kernels.hopper.config import HopperForwardConfig, OStore, Schedule  # noqa: E402
from fmha.kernels.hopper.v_staging import stage_v_fp8, staged_length  # noqa: E402
from fmha.problem import KernelOptions  # noqa: E402
from fmha.validation import validate  # noqa: E402
from kernel_configs import library_config  # noqa: E402

FP8 = torch.float8_e4m3fn


def _qkv(d=64, dtype=torch.bfloat16, s=40):
    g = torch.Generator().manual_seed(d)
    return [torch.randn(2, s, 4, d, generator=g).to(dtype) for _ in range(3)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_every_spec_dtype_and_head_dim_is_supported(dtype, d):
    problem = validate(*_qkv(d, dtype), causal=True)
    assert hc.why_unsupported(problem, KernelOptions()) == []
    cfg = HopperForwardConfig.from_problem(problem, KernelOptions())
    assert (cfg.tile_m, cfg.tile_n) == hc.allowed_tiles(dtype, d)[0]
    assert cfg.v_staged == (dtype == FP8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_tiles_fit_shared_memory_and_the_fp8_key_blocks(dtype, d):
    elem = 1 if dtype == FP8 else 2
    for tm, tn in hc.allowed_tiles(dtype, d):
        for schedule in Schedule:
            q_stages = hc.q_stages_for(schedule, d, 1024)
            o_buffer = hc.o_buffer_reserved(dtype, torch.bfloat16, False, tm, d)  # kept beside an fp8 ring
            assert o_buffer == (tm * d * 2 if dtype == FP8 else 0)
            stages = hc.kv_stages_for(dtype, d, tm, tn, q_stages, o_buffer)
            assert stages >= 4  # two K/V tile pairs at least: loads run a pair ahead
            assert (q_stages * tm + stages * tn) * d * elem + o_buffer <= 227 * 1024 - 2048
        if dtype == FP8:
            assert tn % len(FP8_KEY_ORDER) == 0  # P.V consumes keys in blocks of 32


def test_o_gets_its_own_buffer_only_beside_a_full_kv_ring():
    """Where the K/V ring has reached its cap (head dim <= 64), and with fp8 inputs, O is staged
    in a buffer of its own; elsewhere in the Q buffer, so that the ring keeps its depth. Varlen
    does the same through each sequence's descriptor; fp8 outputs, and fp8 varlen (no buffer
    kept for O), store O directly."""
    def cfg(d, dtype=torch.bfloat16, out=None, varlen=False, persistent=True, seqlen=1024, mask="causal"):
        return library_config(dtype, d, mask, persistent, varlen, out_dtype=out, seqlen_k=seqlen)
    for d in (32, 64):
        for persistent, seqlen in ((True, 1024), (True, 16384), (False, 1024)):
            c = cfg(d, persistent=persistent, seqlen=seqlen)
            assert c.o_store == OStore.TMA_OWN_BUFFER and c.kv_stages == 8
            assert ((c.q_stages + 1) * c.tile_m + c.kv_stages * c.tile_n) * d * 2 <= 227 * 1024 - 2048
    for d in (64, 128, 256):
        c = cfg(d, FP8)  # 16-bit O beside a ring of fp8 K/V: 8 stages, 4 of 128 keys at D=256
        assert c.o_store == OStore.TMA_OWN_BUFFER and c.kv_stages == (4 if d == 256 else 8)
        assert (c.q_stages * c.tile_m + c.kv_stages * c.tile_n) * d + c.tile_m * d * 2 <= 227 * 1024 - 2048
    assert cfg(128).o_store == OStore.TMA_Q_BUFFER and cfg(256).o_store == OStore.TMA_Q_BUFFER
    assert cfg(128, out=torch.float16).o_store == OStore.DIRECT  # the Q buffer holds bf16
    assert cfg(64, FP8, out=FP8).o_store == OStore.DIRECT
    assert cfg(64, varlen=True).o_store == OStore.TMA_OWN_BUFFER and cfg(128, varlen=True).o_store == OStore.TMA_Q_BUFFER
    assert cfg(128, varlen=True).sequence_descriptors == 4 and cfg(256, FP8, varlen=True).sequence_descriptors == 3
    assert cfg(64, out=torch.float16).o_store == OStore.TMA_OWN_BUFFER
    for c in (cfg(256, FP8, varlen=True), cfg(256, FP8, out=FP8)):  # stored directly: no buffer kept
        assert c.o_store == OStore.DIRECT and c.kv_stages == 6


def test_fp8_output_only_from_fp8_inputs_and_tiles_are_checked():
    problem = validate(*_qkv(128, FP8), out_dtype=FP8)
    assert hc.why_unsupported(problem, KernelOptions()) == []
    reasons = hc.why_unsupported(validate(*_qkv(256)), KernelOptions(tile_m=128, tile_n=128))
    assert reasons and "128x80" in reasons[0]
    assert hc.why_unsupported(validate(*_qkv(64)), KernelOptions(tile_m=128)) == []


def test_fp8_key_order_is_a_permutation_of_each_block():
    assert sorted(FP8_KEY_ORDER) == list(range(32))
    # a thread's four A-operand slots hold its own accumulator columns: 2t, 2t+1, 8+2t, 9+2t
    for t in range(4):
        assert FP8_KEY_ORDER[4 * t:4 * t + 4] == (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t)


def _fp8(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 4).to(FP8)


def _expected(v_seq, s_pad):
    """(S, H, D) of one sequence -> (H, D, S_pad) in staged key order."""
    s, h, d = v_seq.shape
    out = torch.zeros(h, d, s_pad)
    for slot in range(s_pad):
        key = slot - slot % 32 + FP8_KEY_ORDER[slot % 32]
        if key < s:
            out[:, :, slot] = v_seq[key].float()
    return out


@pytest.mark.parametrize("s", [1, 31, 32, 70])
def test_stage_v_dense(s):
    v = _fp8(2, s, 3, 16, seed=s)
    staged = stage_v_fp8(v, None, s)
    s_pad = staged_length(s)
    assert staged.dtype == FP8 and staged.shape == (2, 3, 16, s_pad) and staged.is_contiguous()
    for b in range(2):
        assert torch.equal(staged[b].float(), _expected(v[b], s_pad))


def test_stage_v_dense_accepts_a_bhsd_view():
    v = _fp8(2, 3, 40, 16).transpose(1, 2)
    assert torch.equal(stage_v_fp8(v, None, 40), stage_v_fp8(v.contiguous(), None, 40))


def test_stage_v_varlen_pads_each_sequence_from_a_block_boundary():
    lens = [0, 1, 33, 5]
    cu = torch.tensor([0, 0, 1, 34, 39], dtype=torch.int32)
    v = _fp8(sum(lens), 2, 16, seed=3)
    staged = stage_v_fp8(v, cu, max(lens))
    assert staged.shape == (4, 2, 16, 64)
    for b, n in enumerate(lens):
        assert torch.equal(staged[b].float(), _expected(v[cu[b]:cu[b] + n], 64))


def test_stage_v_varlen_with_no_keys_at_all():
    cu = torch.zeros(3, dtype=torch.int32)
    staged = stage_v_fp8(_fp8(0, 2, 16), cu, 0)
    assert staged.shape == (2, 2, 16, 32) and not staged.float().any()


def _recording_runner(problem):
    calls = []
    cfg = HopperForwardConfig.from_problem(problem, KernelOptions())
    return HopperRunner(cfg, lambda *args: calls.append(args)), calls


def test_no_launch_without_query_rows_and_spec_answer_without_keys():
    q = torch.randn(2, 0, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    problem = validate(q, k, k, causal=True)
    runner, calls = _recording_runner(problem)
    runner(problem, q, k, k, torch.empty(2, 0, 4, 64, dtype=torch.bfloat16), None)
    assert calls == []

    q = torch.randn(2, 7, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 0, 4, 64, dtype=torch.bfloat16)
    problem = validate(q, k, k, return_lse=True)
    runner, calls = _recording_runner(problem)
    out = torch.full((2, 7, 4, 64), float("nan"), dtype=torch.bfloat16)
    lse = torch.full((2, 4, 7), float("nan"))
    runner(problem, q, k, k, out, lse)
    assert calls == [] and not out.float().any() and torch.isneginf(lse).all()


CLAIMED, PERSISTENT, ONE_CTA = Schedule.CLAIMED, Schedule.PERSISTENT, Schedule.ONE_CTA_PER_TILE


@pytest.mark.parametrize("b,s,hq,hk,d,causal,dtype,want", [
    # The problem's K/V against half the 50 MB L2:
    (32, 512, 32, 32, 64, True, torch.bfloat16, CLAIMED),    # 134 MB: claimed
    (8, 2048, 32, 32, 64, True, torch.bfloat16, CLAIMED),
    (32, 512, 16, 16, 128, True, torch.bfloat16, CLAIMED),
    (1, 16384, 16, 16, 128, True, torch.bfloat16, CLAIMED),
    (2, 8192, 8, 8, 256, True, torch.bfloat16, CLAIMED),
    (2, 8192, 16, 16, 128, True, torch.float8_e4m3fn, CLAIMED),   # 67 MB
    (8, 2048, 16, 2, 128, True, torch.bfloat16, PERSISTENT),   # GQA 8: 17 MB, the static walk
    (2, 8192, 16, 2, 128, True, torch.bfloat16, PERSISTENT),
    (1, 2048, 8, 8, 128, True, torch.bfloat16, PERSISTENT),    # 4 MB
    (1, 16384, 16, 16, 128, False, torch.bfloat16, PERSISTENT),  # even tile costs: grid-stride
])
def test_causal_tiles_are_claimed_unless_all_kv_fits_half_the_l2(b, s, hq, hk, d, causal, dtype, want):
    import dataclasses

    q, k, v = (t.to(dtype) for t in _qkv(d))
    small = validate(q, k, v, causal=causal)
    problem = dataclasses.replace(small, batch=b, seqlen_q=s, seqlen_k=s, num_heads_q=hq, num_heads_k=hk)
    config = lambda **kw: HopperForwardConfig.from_problem(problem, KernelOptions(**kw))  # noqa: E731
    assert config().schedule == want
    # An explicit persistent= is obeyed as it is: no claiming.
    assert config(persistent=True).schedule == PERSISTENT
    assert config(persistent=False).schedule == ONE_CTA
    if causal:
        # claim_tiles=True claims anywhere (unless persistent=True is pinned); False where the
        # backend would claim gives one CTA per tile, elsewhere changes nothing.
        assert config(claim_tiles=True).schedule == CLAIMED
        assert config(claim_tiles=True, persistent=False).schedule == CLAIMED
        assert config(claim_tiles=True, persistent=True).schedule == PERSISTENT
        assert config(claim_tiles=False).schedule == (ONE_CTA if want == CLAIMED else want)


def test_claimed_tiles_never_for_pinned_persistent_grids_even_costs_or_varlen():
    """Persistent grids, varlen and even tile costs never claim, whatever the option says."""
    import dataclasses

    def claims(problem, **kw):
        return HopperForwardConfig.from_problem(problem, KernelOptions(**kw)).claims_tiles

    big = dataclasses.replace(validate(*_qkv(128), causal=True), batch=4, seqlen_q=4096, seqlen_k=4096,
                              num_heads_q=16, num_heads_k=16)
    assert not claims(big, persistent=True, claim_tiles=True)
    dense = dataclasses.replace(validate(*_qkv(128)), batch=4, seqlen_q=4096, seqlen_k=4096,
                                num_heads_q=16, num_heads_k=16)
    assert not claims(dense, persistent=False, claim_tiles=True)
    lens = [5, 40, 17]
    cu = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    q, k, v = (torch.randn(62, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    varlen = validate(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
                      max_seqlen_k=max(lens), causal=True)
    assert not claims(varlen, persistent=False, claim_tiles=True)
    assert claims(big, persistent=False, claim_tiles=True)


def test_two_q_buffers_only_for_persistent_grids_up_to_4k_keys_and_d128():
    assert hc.q_stages_for(PERSISTENT, 128, 4096) == 2 and hc.q_stages_for(CLAIMED, 64, 512) == 2
    assert hc.q_stages_for(PERSISTENT, 128, 8192) == 1  # long rows: the K/V stage weighs more
    assert hc.q_stages_for(ONE_CTA, 128, 512) == 1 and hc.q_stages_for(PERSISTENT, 256, 512) == 1
    cfg = HopperForwardConfig.from_problem(validate(*_qkv(128)), KernelOptions())
    assert cfg.persistent and cfg.q_stages == 2 and cfg.kv_stages == 5


def _cfg(*tensors, **kw):
    return HopperForwardConfig.from_problem(validate(*tensors, **kw), KernelOptions())


def test_softmax_chains_per_head_dim_and_for_fp8_under_causal_masks():
    assert _cfg(*_qkv(64)).softmax_chains == (4, 2)
    assert _cfg(*_qkv(128)).softmax_chains == (1, 1)
    assert _cfg(*_qkv(128), causal=True).softmax_chains == (1, 1)
    fp8 = [t.to(torch.float8_e4m3fn) for t in _qkv(128)]
    assert _cfg(*fp8).softmax_chains == (1, 1)
    for mask in (dict(causal=True), dict(window_size=(None, 0)), dict(compressed_causal=True)):
        assert _cfg(*fp8, **mask).softmax_chains == (4, 2)
    # a sliding window's rows cost the same: one chain
    assert _cfg(*fp8, window_size=(64, 0)).softmax_chains == (1, 1)


def test_varlen_causal_runs_a_persistent_grid():
    lens = [5, 40, 17]
    cu = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    q, k, v = (torch.randn(62, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    cfg = _cfg(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens),
               max_seqlen_k=max(lens), causal=True)
    assert cfg.schedule == PERSISTENT


def _causal_tile_costs(m_blocks, heads):
    """K/V tiles per query tile of a causal problem, costliest first, heads fastest."""
    return [m + 1 for m in reversed(range(m_blocks)) for _ in range(heads)]


@pytest.mark.parametrize("grid,costs", [
    (132, _causal_tile_costs(16, 128)),  # S=2k, B*H=128
    (132, _causal_tile_costs(128, 16)),  # S=16k, 16 heads: grid-stride spread 125 of a mean 1001
    (132, _causal_tile_costs(4, 512)),   # S=512
    (7, [5, 3, 3, 1]),                   # fewer tiles than CTAs
])
def test_snake_deal_visits_every_tile_once_and_balances_sorted_costs(grid, costs):
    from fmha.kernels.common.scheduler import snake_next

    totals, seen = [], []
    for cta in range(min(grid, len(costs))):
        idx, total = cta, 0
        while idx < len(costs):
            seen.append(idx)
            total += costs[idx]
            idx = snake_next(idx, grid)
        totals.append(total)
    assert sorted(seen) == list(range(len(costs)))
    spread = max(totals) - min(totals)
    stride = [sum(costs[c::grid]) for c in range(min(grid, len(costs)))]  # a grid-stride deal
    assert spread <= max(stride) - min(stride)
    assert spread <= max(costs)


@pytest.mark.parametrize("m_blocks,heads_batches", [(16, 128), (5, 7), (1, 3)])
def test_cost_order_visits_every_tile_once_costliest_first(m_blocks, heads_batches):
    from fmha.kernels.common.scheduler import cost_sorted_tile

    tiles = [cost_sorted_tile(i, m_blocks, heads_batches) for i in range(m_blocks * heads_batches)]
    assert sorted(tiles) == [(m, hb) for m in range(m_blocks) for hb in range(heads_batches)]
    assert [m for m, _ in tiles] == sorted((m for m, _ in tiles), reverse=True)


def test_tma_store_of_o_except_where_measured_slower():
    """D=64 rows that read all of more than 2k keys store O from registers (docs/performance.md);
    every other 16-bit dense configuration stages it for TMA."""
    def store(d, causal, s):
        q = torch.empty(1, s, 2, d, dtype=torch.bfloat16)
        return _cfg(q, q, q, causal=causal).o_store
    assert store(64, False, 4096) == OStore.DIRECT and store(32, False, 16384) == OStore.DIRECT
    assert store(64, False, 2048) != OStore.DIRECT and store(64, True, 16384) != OStore.DIRECT
    assert store(128, False, 16384) != OStore.DIRECT and store(256, False, 8192) != OStore.DIRECT


def test_lazy_rescale_only_for_16_bit_inputs_from_head_dim_128():
    """The stale-max softmax where it measured faster (docs/performance.md); fp8 keeps the exact
    max, whose probability e4m3 holds exactly."""
    def cfg(d, dtype):
        q = torch.empty(1, 300, 2, d, dtype=dtype)
        return _cfg(q, q, q, causal=True)
    assert cfg(128, torch.bfloat16).lazy_rescale and cfg(256, torch.float16).lazy_rescale
    assert not cfg(64, torch.bfloat16).lazy_rescale and not cfg(32, torch.float16).lazy_rescale
    assert not any(cfg(d, torch.float8_e4m3fn).lazy_rescale for d in (64, 128, 256))


def test_a_capped_persistent_grid_ends_with_its_block():
    """``persistent_grid_of`` (the GPU check's and the sanitizer's small grids) sets the CTA count
    persistent launches use, and forgets it on leaving, an exception included, so the next
    launch looks the SM count up again."""
    dev = torch.device("cuda", 0)  # an explicit index: sm_count needs no GPU for a cached entry
    for fail in (False, True):
        try:
            with launch.persistent_grid_of(8, 0):
                assert launch.sm_count(dev) == 8
                if fail:
                    raise RuntimeError("launch failed")
        except RuntimeError:
            assert fail
        assert 0 not in launch._SM_COUNT


@pytest.mark.parametrize("b,s,want", [(1, 16384, CLAIMED), (1, 2048, PERSISTENT)])
def test_block_masks_claim_tiles_longest_first_as_causal_masks_do(b, s, want):
    """A block mask gives each query tile its own list of K/V tiles: the tiles' costs differ,
    so they are claimed (and ordered as causal's) where causal tiles would be."""
    import dataclasses

    from fmha.mods import ModsSignature

    small = validate(*_qkv(128))
    problem = dataclasses.replace(small, batch=b, seqlen_q=s, seqlen_k=s, num_heads_q=16, num_heads_k=16)
    plain = HopperForwardConfig.from_problem(problem, KernelOptions())
    assert plain.schedule == PERSISTENT and not plain.longest_first
    sparse = dataclasses.replace(problem, mods=ModsSignature(None, None, (), True))
    cfg = HopperForwardConfig.from_problem(sparse, KernelOptions())
    assert cfg.schedule == want and cfg.longest_first
