"""Host side of the Blackwell kernel, on the CPU: which K/V tiles a CTA visits and which it masks
(the shared ``kv_walk``, as the kernel takes it) against the semantics' mask predicate (``tests/naive.py``), what the configuration
supports and why not, its TMEM, register and shared-memory budgets, the backend's shape, and a
step-by-step model of the kernel's softmax/correction protocol against the naive attention."""

import itertools
import math

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.blackwell import config as bc  # noqa: E402
from fmha.kernels.blackwell.backend import BlackwellBackend  # noqa: E402
from fmha.kernels.blackwell.config import BlackwellForwardConfig  # noqa: E402
from fmha.kernels.common.kv_walk import kv_walk  # noqa: E402
from fmha.masking import MaskKind, MaskSpec, row_key_bounds  # noqa: E402
from fmha.problem import KernelOptions  # noqa: E402
from fmha.validation import validate  # noqa: E402
from naive import keep_matrix, naive_sequence  # noqa: E402

FP8 = torch.float8_e4m3fn
CTA_ROWS, TILE_N = bc.Q_TILES * bc.TILE_M, bc.TILE_N

# (kind, left, right, bottom_right) in the semantics' terms and as a MaskSpec
MASKS = [
    ("none", None, None, False),
    ("window", None, 0, False),  # causal, top-left
    ("window", None, 0, True),  # causal, bottom-right
    ("window", 100, 30, False),
    ("window", 100, 30, True),
    ("window", 64, None, False),
    ("window", 0, 0, True),
    ("window", None, 200, False),
    ("compressed", None, None, False),
]


def _spec(kind, left, right, bottom_right) -> MaskSpec:
    if kind == "none":
        return MaskSpec()
    if kind == "compressed":
        return MaskSpec(MaskKind.COMPRESSED_CAUSAL)
    return MaskSpec(MaskKind.WINDOW, left, right, bottom_right)


def _lengths(kind):
    sizes = [1, 5, 127, 128, 129, 256, 300, 513]
    for sq, sk in itertools.product(sizes, sizes):
        if kind == "compressed" and not (sk >= 1 and sq >= sk):
            continue  # validation refuses these
        yield sq, sk


def cta_kv_walk(m, cta_rows, tile_n, sq, sk, kind, left, right, bottom_right):
    """The walk as the kernel takes it (``BlackwellForwardKernel.kv_walk``)."""
    return kv_walk(m, cta_rows, tile_n, sq, sk, kind, left, right, bottom_right).at_least_one_tile(sk, tile_n)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"{m[0]}-{m[1]}-{m[2]}-{'br' if m[3] else 'tl'}")
def test_walk_visits_every_kept_key_and_masks_every_partial_tile(mask):
    """For every CTA row block: every key some row keeps lies in a visited tile; every visited tile
    holds a kept key (except the one fully masked step of a block that keeps nothing); a step left
    unmasked is kept whole by every row of the block (so its scores need no mask)."""
    kind, left, right, br = mask
    spec = _spec(*mask)
    for sq, sk in _lengths(kind):
        keep = keep_matrix(sq, sk, dict(kind=kind, left=left, right=right, bottom_right=br))
        for m in range((sq + CTA_ROWS - 1) // CTA_ROWS):
            rows = keep[m * CTA_ROWS:(m + 1) * CTA_ROWS]
            walk = cta_kv_walk(m, CTA_ROWS, TILE_N, sq, sk, spec.kind, spec.window_left, spec.window_right,
                               spec.bottom_right)
            kept_tiles = sorted({j // TILE_N for j in rows.any(0).nonzero().flatten().tolist()})
            visited = list([walk.block(i) for i in range(walk.total)])
            assert walk.total >= 1
            if not kept_tiles:
                assert walk.total == 1 and walk.needs_mask(0), (sq, sk, m)
                assert walk.start * TILE_N >= max(sk, 1), (sq, sk, m)  # zero-filled, nothing read
                continue
            assert visited == kept_tiles, (sq, sk, m, walk)
            for step, n in enumerate(visited):
                cols = rows[:, n * TILE_N:(n + 1) * TILE_N]
                whole = cols.shape[1] == TILE_N and bool(cols.all())
                if not walk.needs_mask(step):
                    assert whole, (sq, sk, m, step, walk)


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: f"{m[0]}-{m[1]}-{m[2]}-{'br' if m[3] else 'tl'}")
def test_row_bands_match_the_semantics(mask):
    """The softmax warpgroups mask a row with ``row_key_bounds`` ([lo, hi) per row), compared
    against each column relative to the tile: the same keys as the semantics' predicate."""
    kind, left, right, br = mask
    spec = _spec(*mask)
    for sq, sk in _lengths(kind):
        keep = keep_matrix(sq, sk, dict(kind=kind, left=left, right=right, bottom_right=br))
        for i in range(sq):
            lo, hi = row_key_bounds(i, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right)
            band = torch.zeros(sk, dtype=torch.bool)
            band[max(lo, 0):max(min(hi, sk), 0)] = True
            assert torch.equal(band, keep[i]), (sq, sk, i)


def _simulate_cta(q, k, v, spec: MaskSpec, score_scale, out_scale, p_dtype):
    """The kernel's per-CTA protocol on the host, step for step (fp64 apart from P's rounding):
    per K/V step each Q tile's softmax takes the new max (-inf treated as 0), hands (old, new) to
    the correction, which rescales O by exp2((old - new) * s2) before the MMA adds this step's
    P V; the row sum is carried likewise; after the last step O is normalized and the LSE taken."""
    sq, sk = q.shape[0], k.shape[0]
    s2 = score_scale * math.log2(math.e)
    o = torch.zeros(sq, v.shape[1], dtype=torch.float64)
    lse = torch.full((sq,), -math.inf, dtype=torch.float64)
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64)
    for m in range((sq + CTA_ROWS - 1) // CTA_ROWS):
        walk = cta_kv_walk(m, CTA_ROWS, TILE_N, sq, sk, spec.kind, spec.window_left, spec.window_right,
                           spec.bottom_right)
        for t in range(bc.Q_TILES):
            rows = torch.arange(m * CTA_ROWS + t * bc.TILE_M, m * CTA_ROWS + (t + 1) * bc.TILE_M)
            rows = rows[rows < sq]  # rows past the end are computed on zeros and never stored
            if len(rows) == 0:
                continue
            bounds = [row_key_bounds(r, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right)
                      for r in rows.tolist()]
            lo = torch.tensor([b[0] for b in bounds])[:, None]
            hi = torch.tensor([b[1] for b in bounds])[:, None]
            row_max = torch.full((len(rows),), -math.inf, dtype=torch.float64)
            row_sum = torch.zeros(len(rows), dtype=torch.float64)
            acc = torch.zeros(len(rows), v.shape[1], dtype=torch.float64)
            for step in range(walk.total):
                col_base = walk.block(step) * TILE_N
                cols = torch.arange(col_base, col_base + TILE_N)
                inside = (cols >= 0) & (cols < sk)
                kk = torch.zeros(TILE_N, k.shape[1], dtype=torch.float64)
                vv = torch.zeros(TILE_N, v.shape[1], dtype=torch.float64)
                kk[inside] = k[cols[inside]].double()  # TMA zero-fills past the end
                vv[inside] = v[cols[inside]].double()
                s = q[rows].double() @ kk.T
                if walk.needs_mask(step):
                    s = torch.where((cols[None] >= lo) & (cols[None] < hi), s, neg_inf)
                old = row_max
                row_max = torch.maximum(row_max, s.max(1).values)
                safe = torch.where(torch.isneginf(row_max), 0.0, row_max)
                factor = torch.exp2((old - safe) * s2)
                if step > 0:
                    acc *= factor[:, None]  # the correction warpgroup, before this step's P V
                p = torch.exp2(s * s2 - (safe * s2)[:, None])
                row_sum = row_sum * factor + p.sum(1)
                acc += p.to(p_dtype).double() @ vv
            kept = row_sum > 0
            o[rows[kept]] = acc[kept] * (out_scale / row_sum[kept])[:, None]
            lse[rows[kept]] = (row_max[kept] * s2 + torch.log2(row_sum[kept])) * math.log(2.0)
    return o, lse


@pytest.mark.parametrize("mask", MASKS[:5] + MASKS[8:], ids=lambda m: f"{m[0]}-{m[2]}-{'br' if m[3] else 'tl'}")
@pytest.mark.parametrize("sq,sk", [(300, 513), (5, 300), (257, 129), (1, 1), (513, 257)])
def test_protocol_model_matches_naive_attention(mask, sq, sk):
    """The kernel's step order (``_simulate_cta``) reproduces the semantics, empty rows included
    (O = 0, LSE = -inf), with P rounded to bf16 as the P V MMA reads it."""
    kind, left, right, br = mask
    if kind == "compressed" and sq < sk:
        pytest.skip("compressed causal needs S_q >= S_k")
    g = torch.Generator().manual_seed(sq * 1000 + sk)
    d = 32
    q, k, v = (torch.randn(n, d, generator=g) for n in (sq, sk, sk))
    scale, out_scale = 1 / math.sqrt(d), 0.75
    o, lse = _simulate_cta(q, k, v, _spec(*mask), scale, out_scale, torch.bfloat16)
    o_ref, lse_ref = naive_sequence(q[:, None], k[:, None], v[:, None],
                                    dict(kind=kind, left=left, right=right, bottom_right=br),
                                    softmax_scale=scale, inv_scale_o=out_scale)
    assert torch.allclose(o, o_ref[:, 0], atol=2e-2, rtol=2e-2)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref[0]))
    finite = torch.isfinite(lse_ref[0])
    assert torch.allclose(lse[finite], lse_ref[0][finite], atol=1e-6)


def _qkv(d=64, dtype=torch.bfloat16, s=40, heads_q=4, heads_k=4):
    g = torch.Generator().manual_seed(d)
    return [torch.randn(2, s, h, d, generator=g).to(dtype) for h in (heads_q, heads_k, heads_k)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, FP8])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_every_served_dtype_and_head_dim_is_supported(dtype, d):
    problem = validate(*_qkv(d, dtype, heads_k=2), causal=True, return_lse=True)
    assert bc.why_unsupported(problem, KernelOptions()) == []
    cfg = BlackwellForwardConfig.from_problem(problem, KernelOptions())
    assert cfg.arch == "sm_100a" and cfg.persistent and cfg.has_lse
    assert bc.tmem_columns_needed(d) <= cfg.tmem_columns <= bc.TMEM_COLUMNS


def test_head_dim_256_is_refused_with_the_tmem_reason():
    problem = validate(*_qkv(256))
    reasons = bc.why_unsupported(problem, KernelOptions())
    assert len(reasons) == 1 and "768 of the 512 TMEM columns" in reasons[0]
    with pytest.raises(ValueError):
        BlackwellForwardConfig.from_problem(problem, KernelOptions())


def test_other_refusals_say_what_to_change():
    problem = validate(*_qkv(64))
    assert "tile is 256x128" in bc.why_unsupported(problem, KernelOptions(tile_m=128, tile_n=64))[0]
    assert bc.why_unsupported(problem, KernelOptions(tile_m=256, tile_n=128)) == []
    assert "claim" in bc.why_unsupported(problem, KernelOptions(claim_tiles=True))[0]
    assert BlackwellForwardConfig.from_problem(problem, KernelOptions(persistent=False)).persistent is False


@pytest.mark.parametrize("dtype,out", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                       (FP8, torch.bfloat16), (FP8, FP8)])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_shared_memory_and_register_budgets(dtype, out, d):
    """Two Q tiles, two O staging tiles and the K/V ring fit the SM's shared memory (the compile
    checks the real struct too); the per-role register budgets fill the register file exactly."""
    elem, out_elem = (1 if dtype == FP8 else 2), (1 if out == FP8 else 2)
    stages = bc.kv_stages_for(dtype, d, out)
    used = 2 * 128 * d * (elem + out_elem) + stages * 128 * d * elem
    assert 2 <= stages <= 8 and used <= bc.SMEM_BYTES
    total = 2 * 128 * bc.REGISTERS_SOFTMAX + 128 * bc.REGISTERS_CORRECTION + 128 * bc.REGISTERS_OTHER
    assert total == 64 * 1024
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in
               (bc.REGISTERS_SOFTMAX, bc.REGISTERS_CORRECTION, bc.REGISTERS_OTHER))


def test_backend_shape():
    backend = BlackwellBackend()
    assert backend.name == "blackwell"
    assert set(backend.capabilities) == {(10, 0), (10, 3)}
    problem = validate(*_qkv(128), window_size=(64, 0), mask_align="bottom_right")
    key = backend.cache_key(problem, KernelOptions())
    assert key == backend.cache_key(problem, KernelOptions()) and hash(key) is not None
    assert key.mask_kind == MaskKind.WINDOW and key.window_left_bounded and key.bottom_right
    assert backend.why_unsupported(problem, KernelOptions()) == []
    varlen = validate(torch.zeros(10, 4, 64, dtype=torch.bfloat16), torch.zeros(12, 2, 64, dtype=torch.bfloat16),
                      torch.zeros(12, 2, 64, dtype=torch.bfloat16), varlen=True,
                      cu_seqlens_q=torch.tensor([0, 0, 1, 10], dtype=torch.int32),
                      cu_seqlens_k=torch.tensor([0, 5, 5, 12], dtype=torch.int32))
    cfg = backend.cache_key(varlen, KernelOptions())
    assert cfg.varlen and not cfg.o_via_tma


def test_runner_arguments_and_early_exits(monkeypatch):
    """What the runner hands the compiled kernel (in ``BlackwellAttentionForward.__call__``'s
    order): varlen gets the tile table of 256-row blocks that hold rows, the descriptor buffer
    and the error flag; nothing launches without query rows; without keys O = 0 and LSE = -inf."""
    from fmha.kernels.blackwell import backend as bb

    monkeypatch.setattr(bb.device_errors, "flag", lambda device: "flag")
    monkeypatch.setattr(bb, "sm_count", lambda device: 148)
    calls = []
    lens_q, lens_k = [0, 1, 300], [5, 0, 260]
    cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32)  # noqa: E731
    q = torch.zeros(sum(lens_q), 4, 64, dtype=torch.bfloat16)
    k = torch.zeros(sum(lens_k), 2, 64, dtype=torch.bfloat16)
    problem = validate(q, k, k, varlen=True, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), causal=True,
                       return_lse=True)
    cfg = BlackwellForwardConfig.from_problem(problem, KernelOptions())
    runner = bb.BlackwellRunner(cfg, lambda *args: calls.append(args))
    out, lse = torch.empty_like(q), torch.empty(4, sum(lens_q))
    runner(problem, q, k, k, out, lse, cu(lens_q), cu(lens_k))
    (args,) = calls
    args = bb.ForwardArgs(*args)
    assert args.mO is out and args.mLSE is lse and args.mErrors == "flag"
    assert args.mTileTable.tolist() == [[2, 1], [2, 0], [1, 0]]  # (batch, 256-row block), costliest first
    assert tuple(args.mSeqDescriptors.shape) == (3, 3, 16)
    assert args.mSinks is None and args.softcap_factor is None
    assert args.max_seqlen_q == 300 and args.num_ctas == 148 and args.window_left is None and args.window_right == 0

    dense_q = torch.zeros(1, 0, 4, 64, dtype=torch.bfloat16)
    dense_k = torch.zeros(1, 7, 4, 64, dtype=torch.bfloat16)
    empty_q = validate(dense_q, dense_k, dense_k)
    bb.BlackwellRunner(BlackwellForwardConfig.from_problem(empty_q, KernelOptions()), None)(
        empty_q, dense_q, dense_k, dense_k, torch.empty_like(dense_q), None)
    dense_q = torch.zeros(1, 5, 4, 64, dtype=torch.bfloat16)
    dense_k = torch.zeros(1, 0, 4, 64, dtype=torch.bfloat16)
    no_keys = validate(dense_q, dense_k, dense_k, return_lse=True)
    out, lse = torch.full_like(dense_q, 3.0), torch.zeros(1, 4, 5)
    bb.BlackwellRunner(BlackwellForwardConfig.from_problem(no_keys, KernelOptions()), None)(
        no_keys, dense_q, dense_k, dense_k, out, lse)
    assert not out.any() and torch.isneginf(lse).all()
