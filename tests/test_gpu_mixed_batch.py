"""Mixed batches on a Hopper GPU (marked ``gpu``): packed query rows of any per-sequence length
(decodes of one row, chunked prefills of hundreds, empty sequences) over a dense or paged KV cache
(pages of 1..256 keys in shuffled order, cache lengths that are not multiples of the page or the
tile, empty caches), as serving engines call ``flash_attn_varlen_func(..., seqused_k=,
block_table=)``: ``fmha.attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seqused_k=,
block_table=)`` through the kernel against the fp32 reference on the same inputs, with GQA
packing, causal, window and unmasked rows, sinks, softcap, head dims 64..256 and V's unlike Q's.
Outputs are NaN-poisoned before the call and cache rows past each length are NaN (a kernel that
read them into P.V would return NaN). Bad offsets, lengths and block tables raise through
``fmha.check_device_errors``; a step replays from a CUDA graph with new lengths in the same
buffers (a fixed maximum batch, padded query rows)."""

import os
from dataclasses import dataclass

import pytest
import torch

import fmha
import gpu_cases
from fmha.kvcache import quantize_for_cache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper (SM90) GPU")]

O_TOL = {torch.bfloat16: 1e-2, torch.float16: 5e-3}  # relative L2 against the fp32 reference
LSE_TOL = 1e-3


@dataclass(frozen=True)
class MixedCase:
    rows: tuple  # query rows per sequence
    keys: tuple  # keys per sequence (seqused_k), its rows' own included
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128
    head_dim_v: int = 0  # 0: head_dim
    page_size: int = 64  # 0: a dense cache
    causal: bool = True
    window: tuple = (None, None)
    softcap: float = 0.0
    sinks: bool = False
    pad_rows: int = 0  # query rows past cu_seqlens_q[-1] (an engine's fixed-size batch)
    dtype: torch.dtype = torch.bfloat16
    fp8_cache: bool = False  # the cache in float8_e4m3fn, quantized with SCALE_K / SCALE_V

    @property
    def capacity(self) -> int:
        most = max(self.keys + (1,))
        return -(-most // self.page_size) * self.page_size if self.page_size else most

    def name(self) -> str:
        cache = f"paged{self.page_size}" if self.page_size else "dense"
        mask = "causal" if self.causal else f"win{self.window}" if self.window != (None, None) else "none"
        dv = f"/{self.head_dim_v}" if self.head_dim_v else ""
        extra = "".join(f"-{k}" for k, on in (("softcap", self.softcap), ("sinks", self.sinks), ("fp8", self.fp8_cache),
                                               (f"pad{self.pad_rows}", self.pad_rows)) if on)
        return (f"{cache}-h{self.heads_q}/{self.heads_k}-d{self.head_dim}{dv}-rows{list(self.rows)}"
                f"-keys{list(self.keys)}-{mask}{extra}-{str(self.dtype)[6:]}")


DECODES = tuple([1] * 12)
CASES = [
    # 4 chunked prefills among decodes, keys far past the rows (earlier chunks cached)
    MixedCase((300, 1, 1, 517, 1, 0, 1, 129, 1, 64), (1000, 77, 1, 2047, 4000, 5, 64, 129, 300, 1500)),
    MixedCase((1,) * 20, tuple(range(1, 4000, 200))),  # decodes only
    MixedCase((700, 3, 0, 1), (700, 3, 0, 1), heads_q=16, heads_k=2, page_size=16),  # prefills from empty caches
    MixedCase((5, 1, 40), (0, 1, 17), heads_q=8, heads_k=8, page_size=32),  # rows before the keys: empty rows
    MixedCase((64, 1, 9, 1), (1000, 513, 256, 257), heads_q=16, heads_k=4, page_size=256, causal=False,
              window=(100, 0)),
    MixedCase((33, 1, 2), (90, 450, 2), heads_q=8, heads_k=2, head_dim=64, page_size=48, causal=False),
    MixedCase((17, 1, 1), (300, 3000, 1), heads_q=16, heads_k=2, head_dim=256, page_size=80, causal=False,
              window=(None, -3)),  # band offset: keys at least 3 back
    MixedCase((130, 1), (2000, 900), heads_q=16, heads_k=16, page_size=0),  # dense cache, no packing
    MixedCase((50, 1, 7), (500, 64, 7), heads_q=32, heads_k=4, head_dim=192, head_dim_v=128, page_size=64),
    MixedCase((200, 1, 1, 3), (1200, 999, 2, 3), softcap=30.0, sinks=True, pad_rows=5),
    MixedCase((9, 1), (45, 300), heads_q=12, heads_k=4, head_dim=64, page_size=16, dtype=torch.float16,
              window=(20, 3), causal=False),
    MixedCase(DECODES + (256,), tuple(range(5, 1205, 100)) + (256,), page_size=128, sinks=True),
    MixedCase((300, 1, 1, 517, 1, 0, 1, 129, 1, 64), (1000, 77, 1, 2047, 4000, 5, 64, 129, 300, 1500),
              fp8_cache=True),
    MixedCase((33, 1, 2), (90, 450, 2), heads_q=8, heads_k=2, head_dim=64, page_size=48, causal=False,
              dtype=torch.float16, fp8_cache=True),
    MixedCase((130, 1), (2000, 900), heads_q=16, heads_k=16, page_size=0, softcap=30.0, sinks=True,
              fp8_cache=True),
    # small pages and pages not a multiple of 16 (runs of gcd(page, tile) keys)
    MixedCase((300, 1, 1, 17, 1), (1000, 77, 1, 2047, 40), heads_q=16, heads_k=4, page_size=1),
    MixedCase((33, 1, 2), (90, 450, 2), heads_q=8, heads_k=2, head_dim=64, page_size=6, causal=False,
              fp8_cache=True),  # 64-byte fp8 rows: runs of 2 keys keep each TMA box 128-byte aligned
    MixedCase((64, 1, 9), (1000, 513, 256), heads_q=16, heads_k=4, page_size=24, causal=False, window=(100, 0)),
]
#: an fp8 cache's dequantization factors (values = stored x scale)
SCALE_K, SCALE_V = 0.05, 0.02


def _random_cases(count: int, seed: int = 2026) -> list:
    """Mixed batches drawn at random (fixed seed): 1-24 sequences, mostly decodes with some empty
    sequences and chunks of up to 300 rows, keys from none to 5000 (at least the rows, or fewer:
    rows before the first key), pages of 16..256 keys, bf16 or fp8 caches, causal, no mask or a
    window."""
    import random

    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        rows, keys = [], []
        for _ in range(rng.randint(1, 24)):
            n = rng.choice([0, 1, 1, 1, 1, rng.randint(2, 300)])
            rows.append(n)
            keys.append(max(0, n + rng.choice([0, rng.randint(0, 4700), -rng.randint(0, 10)])))
        mask = rng.choice([dict(), dict(causal=False), dict(causal=False, window=(rng.randint(0, 300), 0))])
        cases.append(MixedCase(tuple(rows), tuple(keys), page_size=rng.choice([16, 32, 48, 64, 128, 256]),
                               fp8_cache=rng.random() < 0.5, **mask))
    return cases


CASES += _random_cases(6)


def _inputs(case: MixedCase, seed: int):
    """q (packed, plus padding rows), the caches (rows past each length and unused pages NaN),
    cu_seqlens_q, seqused_k, the block table (pages shuffled, unused entries -1), sinks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, dev, dt = len(case.rows), "cuda", case.dtype
    dv = case.head_dim_v or case.head_dim

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    total = sum(case.rows) + case.pad_rows
    q = rand(total, case.heads_q, case.head_dim)
    cu = torch.tensor([0] + torch.tensor(case.rows).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    dense_k = rand(batch, case.capacity, case.heads_k, case.head_dim)
    dense_v = rand(batch, case.capacity, case.heads_k, dv)
    for b, n in enumerate(case.keys):
        dense_k[b, n:] = float("nan")
        dense_v[b, n:] = float("nan")
    seqused = torch.tensor(case.keys, dtype=torch.int32, device=dev)
    table, k_cache, v_cache = None, dense_k, dense_v
    if case.page_size:
        per_seq = case.capacity // case.page_size
        order = torch.randperm(batch * per_seq + 3, generator=torch.Generator().manual_seed(seed))
        k_cache = torch.full((batch * per_seq + 3, case.page_size, case.heads_k, case.head_dim), float("nan"),
                             dtype=dt, device=dev)
        v_cache = torch.full((batch * per_seq + 3, case.page_size, case.heads_k, dv), float("nan"), dtype=dt,
                             device=dev)
        table = torch.full((batch, per_seq + 1), -1, dtype=torch.int32, device=dev)
        for b in range(batch):
            for i in range(per_seq):
                page = int(order[b * per_seq + i])
                table[b, i] = page
                k_cache[page] = dense_k[b, i * case.page_size:(i + 1) * case.page_size]
                v_cache[page] = dense_v[b, i * case.page_size:(i + 1) * case.page_size]
    if case.fp8_cache:  # NaN stays NaN
        k_cache = quantize_for_cache(k_cache, SCALE_K, torch.float8_e4m3fn)
        v_cache = quantize_for_cache(v_cache, SCALE_V, torch.float8_e4m3fn)
    sinks = torch.randn(case.heads_q, generator=g, device=dev) if case.sinks else None
    return q, k_cache, v_cache, cu, seqused, table, sinks


def _kwargs(case: MixedCase) -> dict:
    scales = dict(scale_k=SCALE_K, scale_v=SCALE_V) if case.fp8_cache else {}
    return dict(causal=case.causal, window_size=case.window, softcap=case.softcap,
                max_seqlen_q=max(case.rows + (1,)), **scales)


def _problem(case: MixedCase, index: int):
    from fmha.kvcache import decode_problem

    q, k, v, cu, seqused, table, sinks = _inputs(case, index)
    kw = _kwargs(case)
    problem, _ = decode_problem(q, k, v, seqused, block_table=table, cu_seqlens_q=cu,
                                max_seqlen_q=kw.pop("max_seqlen_q"), sinks=sinks, return_lse=True, **kw)
    return problem


@pytest.fixture(scope="session")
def mixed_kernels(request, tmp_path_factory):
    """Every kernel the cases use, compiled in parallel into a fresh disk cache first."""
    from fmha.jit.launch import sm_count
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner

    cache_dir = str(tmp_path_factory.mktemp("mixed_kernels"))
    os.environ["FMHA_CACHE_DIR"] = cache_dir
    configs = set()
    for i, case in enumerate(CASES):
        problem = _problem(case, i)
        configs.add(HopperDecodeRunner(problem).plan(problem, sm_count(problem.device)).cfg)
    workers = request.config.getoption("--gpu-workers") or max(1, (os.cpu_count() or 2) - 1)
    gpu_cases.compile_all(sorted(configs, key=repr), cache_dir, workers)
    return configs


def _check(case: MixedCase, out, lse, want_o, want_lse, real_rows: int):
    out, lse = out[:real_rows], lse[:, :real_rows]
    want_o, want_lse = want_o[:real_rows].float(), want_lse[:, :real_rows]
    assert not out.isnan().any() and not lse.isnan().any(), "unwritten or NaN elements"
    empty = torch.isneginf(want_lse) if not case.sinks else torch.zeros_like(want_lse, dtype=torch.bool)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.all(out.transpose(0, 1)[empty] == 0)
    finite = torch.isfinite(want_lse)
    if finite.any():
        assert (lse[finite] - want_lse[finite]).abs().max().item() < LSE_TOL
        err = (out.float() - want_o).norm().item() / max(want_o.norm().item(), 1e-30)
        assert err < O_TOL[case.dtype], err


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name() for c in CASES])
def test_a_mixed_batch_matches_the_reference(index, mixed_kernels):
    case = CASES[index]
    q, k, v, cu, seqused, table, sinks = _inputs(case, index)
    dv = v.shape[-1]
    out = torch.full(q.shape[:-1] + (dv,), float("nan"), dtype=case.dtype, device="cuda")
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda")
    fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, sinks=sinks, out=out, lse=lse,
                          backend="kernel", **_kwargs(case))
    fmha.check_device_errors()  # a valid call raises no flag
    want_o, want_lse = fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, sinks=sinks,
                                             return_lse=True, backend="reference", **_kwargs(case))
    _check(case, out, lse, want_o, want_lse, sum(case.rows))


def test_the_plan_is_the_mixed_batch_configuration(mixed_kernels):
    """The decode runner plans a mixed batch as packed queries over the cache: varlen Q, cache
    lengths, tiles listed on the GPU, pages, GQA rows packed (the calls above force the kernel
    with backend="kernel"; the graph test below shows that nothing is read back)."""
    from fmha.jit.launch import sm_count
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner

    problem = _problem(CASES[0], 0)
    plan = HopperDecodeRunner(problem).plan(problem, sm_count(problem.device))
    assert plan.cfg.varlen and plan.cfg.cache_lengths and plan.cfg.tiles_on_device and plan.cfg.page_run
    assert plan.cfg.rows_per_query == 4 and plan.packed


def test_bad_offsets_lengths_and_block_tables_raise_through_the_device_flag(mixed_kernels):
    case = CASES[2]  # paged, 16-key pages
    q, k, v, cu, seqused, table, _ = _inputs(case, 2)
    kw = _kwargs(case)
    too_long = seqused.clone()
    too_long[1] = table.shape[1] * case.page_size + 1  # past what the block table holds
    fmha.attention_varlen(q, k, v, cu, seqused_k=too_long, block_table=table, backend="kernel", **kw)
    with pytest.raises(ValueError, match="cache_seqlens"):
        fmha.check_device_errors()
    bad_table = table.clone()
    bad_table[0, 2] = k.shape[0] + 5  # not a page, below sequence 0's length
    fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=bad_table, backend="kernel", **kw)
    with pytest.raises(ValueError, match="block_table"):
        fmha.check_device_errors()
    bad_cu = cu.clone()
    bad_cu[2] = bad_cu[1] - 1  # out of order
    fmha.attention_varlen(q, k, v, bad_cu, seqused_k=seqused, block_table=table, backend="kernel", **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        fmha.check_device_errors()
    fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, backend="kernel", **kw)
    fmha.check_device_errors()  # the flag was cleared


def test_a_mixed_step_replays_from_a_cuda_graph_with_new_lengths(mixed_kernels):
    """An engine's step: buffers of a fixed size (query rows padded), captured once; each replay
    reads the offsets and lengths the buffers hold then."""
    case = CASES[0]
    q, k, v, cu, seqused, table, _ = _inputs(case, 0)
    kw = _kwargs(case)
    kw["max_seqlen_q"] = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device="cuda")
    lse = torch.empty((q.shape[1], q.shape[0]), device="cuda")

    def step():
        fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, out=out, lse=lse, backend="kernel",
                              **kw)

    graph = gpu_cases.capture_graph(step, torch)
    # a new batch in the same buffers: other row counts (fewer rows in all, the rest padding) and
    # keys (at most each cache's valid ones: NaN follows those)
    rows = [1, 1, 1, 400, 0, 2, 1, 50, 1, 64]
    keys = [500, 77, 1, 2047, 3000, 5, 64, 129, 300, 64]
    cu.copy_(torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32))
    seqused.copy_(torch.tensor(keys, dtype=torch.int32))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    fmha.check_device_errors()
    want_o, want_lse = fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, return_lse=True,
                                             backend="reference", **kw)
    new_case = MixedCase(tuple(rows), tuple(keys))
    _check(new_case, out, lse, want_o, want_lse, sum(rows))


def test_flash_attention_varlen_with_a_page_table_takes_the_mixed_path(mixed_kernels):
    """``fmha.flash_attn.flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=, seqused_k=,
    page_table=)``, FlashAttention-4's serving call, runs the same kernel (no gather)."""
    from fmha.flash_attn import flash_attn_varlen_func

    case = CASES[0]
    q, k, v, cu, seqused, table, _ = _inputs(case, 0)
    out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, seqused_k=seqused, page_table=table,
                                      max_seqlen_q=max(case.rows), causal=True, return_lse=True)
    want_o, want_lse = fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table, return_lse=True,
                                             backend="kernel", **_kwargs(case))
    assert torch.equal(out, want_o) and torch.equal(lse, want_lse)
