"""Decode over a KV cache on a Hopper GPU (marked ``gpu``): ``attention_with_kvcache`` through the
kernel against the fp32 reference on the same inputs, for dense and paged caches (pages shuffled,
page sizes 1..256, lengths that are not multiples of the page or the tile, empty caches), GQA
packing, split-KV with the heuristic's and given split counts, chunked prefill (hundreds of query
rows against a paged cache), appended keys, causal and window
masks, and rows past each cache's length poisoned with NaN (a kernel that read them into P.V
would return NaN), fp8 caches with float and tensor scales. Outputs are NaN-poisoned before the
call so unwritten elements show. Bad lengths and block tables raise through
``fmha.check_device_errors``; a decode call replays from a CUDA graph (an fp8 one with new
scales in its scale tensors)."""

import os
from dataclasses import dataclass
from typing import Optional

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
class DecodeCase:
    seqlen_q: int
    heads_q: int
    heads_k: int
    head_dim: int
    lengths: tuple  # cached keys per sequence (before any appended ones)
    capacity: int  # keys a sequence can hold
    page_size: int = 0  # 0: dense cache
    seqlen_new: int = 0
    causal: bool = True
    window: tuple = (None, None)
    num_splits: Optional[int] = None
    dtype: torch.dtype = torch.bfloat16
    fp8_cache: bool = False  # the cache in float8_e4m3fn, quantized with SCALE_K / SCALE_V
    #: the fp8 cache's scales as tensors: "head" (H_k,), "seq_head" (B, H_k) (dense caches)
    tensor_scales: Optional[str] = None

    def name(self) -> str:
        cache = f"paged{self.page_size}" if self.page_size else "dense"
        cache += "-fp8" if self.fp8_cache else ""
        cache += f"-scales_{self.tensor_scales}" if self.tensor_scales else ""
        mask = "causal" if self.causal else f"win{self.window}" if self.window != (None, None) else "none"
        return (f"{cache}-q{self.seqlen_q}-h{self.heads_q}/{self.heads_k}-d{self.head_dim}-L{list(self.lengths)}"
                f"-new{self.seqlen_new}-{mask}-splits{self.num_splits}-{str(self.dtype)[6:]}")


CASES = [
    DecodeCase(1, 32, 8, 128, (0, 1, 513, 1000), 1000),  # the heuristic splits 32 tiles
    DecodeCase(1, 32, 8, 128, (0, 1, 513, 1000), 1000, num_splits=1),  # packed, not split
    DecodeCase(4, 8, 8, 64, (777, 300, 5), 777, num_splits=3),  # not packed, split, causal rows
    DecodeCase(16, 64, 8, 128, (1999, 17), 2000, causal=False, window=(100, 0)),  # 128 packed rows
    DecodeCase(20, 16, 2, 128, (640, 31), 700, num_splits=2),  # 160 packed rows: two query tiles
    DecodeCase(5, 4, 2, 64, (91, 200), 256, causal=False),  # no mask
    DecodeCase(1, 16, 2, 256, (333, 1000), 1000),
    DecodeCase(1, 4, 4, 32, (70, 0, 33), 96, page_size=32),
    DecodeCase(1, 32, 8, 128, (0, 15, 16, 17, 700), 704, page_size=16),
    DecodeCase(3, 8, 2, 64, (48 * 5 + 7, 1), 48 * 8, page_size=48, num_splits=1),
    DecodeCase(1, 32, 4, 128, (4000, 256, 257), 4096, page_size=256),
    DecodeCase(2, 32, 8, 128, (129, 0, 300), 512, page_size=128, seqlen_new=2),
    DecodeCase(3, 8, 8, 64, (10, 0), 64, seqlen_new=3),
    DecodeCase(1, 32, 8, 128, (65000,), 65536),  # one long sequence: many splits
    DecodeCase(1, 32, 8, 128, (0, 0, 0), 512, page_size=64),  # every cache empty
    DecodeCase(2, 16, 4, 128, (300, 45), 320, page_size=80, causal=False, window=(20, 3), dtype=torch.float16),
    DecodeCase(300, 16, 4, 128, (1000, 301), 1024, page_size=64),  # chunked prefill: full query tiles
    DecodeCase(100, 8, 2, 64, (500, 100), 512, page_size=32, num_splits=2),  # 400 packed rows, split
    # fp8 caches under a 16-bit query (converted in shared memory)
    DecodeCase(1, 32, 8, 128, (0, 1, 513, 1000), 1000, fp8_cache=True),
    DecodeCase(4, 8, 8, 64, (777, 300, 5), 777, num_splits=3, fp8_cache=True),
    DecodeCase(1, 16, 2, 256, (333, 1000), 1000, fp8_cache=True),
    DecodeCase(1, 32, 8, 128, (0, 15, 16, 17, 700), 704, page_size=16, fp8_cache=True),
    DecodeCase(3, 8, 2, 64, (48 * 5 + 7, 1), 48 * 8, page_size=48, num_splits=1, fp8_cache=True),
    DecodeCase(2, 32, 8, 128, (129, 0, 300), 512, page_size=128, seqlen_new=2, fp8_cache=True),
    DecodeCase(2, 16, 4, 128, (300, 45), 320, page_size=80, causal=False, window=(20, 3), dtype=torch.float16,
               fp8_cache=True),
    DecodeCase(300, 16, 4, 128, (1000, 301), 1024, page_size=64, fp8_cache=True),
    DecodeCase(1, 32, 8, 128, (65000,), 65536, fp8_cache=True),
    DecodeCase(1, 32, 8, 128, (0, 1, 513, 1000), 1000, fp8_cache=True, tensor_scales="seq_head"),
    DecodeCase(4, 8, 8, 64, (777, 300, 5), 777, num_splits=3, fp8_cache=True, tensor_scales="seq_head"),
    DecodeCase(2, 32, 8, 128, (129, 0, 300), 512, page_size=128, seqlen_new=2, fp8_cache=True,
               tensor_scales="head"),
    # pages smaller than 16 keys or not a multiple of 16: each tile loads in runs of gcd(page, tile) keys
    DecodeCase(1, 32, 8, 128, (0, 1, 2, 17, 700), 704, page_size=1),  # token-granular (SGLang's default)
    DecodeCase(3, 8, 2, 64, (7 * 5 + 3, 1, 0), 7 * 8, page_size=7, num_splits=2),  # runs of one key
    DecodeCase(2, 16, 4, 128, (300, 45), 320, page_size=8, causal=False, window=(20, 3), dtype=torch.float16),
    DecodeCase(2, 32, 8, 128, (129, 0, 300), 512, page_size=4, seqlen_new=2),  # appended into 4-key pages
    DecodeCase(100, 8, 2, 64, (500, 100), 504, page_size=24, num_splits=2),  # runs of 8, 400 packed rows
    DecodeCase(1, 32, 8, 128, (0, 15, 16, 17, 700), 704, page_size=1, fp8_cache=True),
    DecodeCase(2, 16, 4, 128, (300, 45), 312, page_size=24, fp8_cache=True, tensor_scales="head"),
]
#: an fp8 cache's dequantization factors (values = stored x scale); unit-normal keys and values
#: stay well inside e4m3's range
SCALE_K, SCALE_V = 0.05, 0.02


def _inputs(case: DecodeCase, seed: int):
    """q, the caches (rows past each length NaN, unused pages NaN), cache_seqlens, block table
    (pages shuffled, unused entries -1), k_new/v_new."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, dev, dt = len(case.lengths), "cuda", case.dtype

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=dev).to(dt)

    q = rand(batch, case.seqlen_q, case.heads_q, case.head_dim)
    dense_k = rand(batch, case.capacity, case.heads_k, case.head_dim)
    dense_v = rand(batch, case.capacity, case.heads_k, case.head_dim)
    for b, n in enumerate(case.lengths):
        dense_k[b, n:] = float("nan")
        dense_v[b, n:] = float("nan")
    seqlens = torch.tensor(case.lengths, dtype=torch.int32, device=dev)
    table = None
    k_cache, v_cache = dense_k, dense_v
    if case.page_size:
        per_seq = case.capacity // case.page_size
        spare = 3
        order = torch.randperm(batch * per_seq + spare, generator=torch.Generator().manual_seed(seed))
        k_cache = torch.full((batch * per_seq + spare, case.page_size, case.heads_k, case.head_dim), float("nan"),
                             dtype=dt, device=dev)
        v_cache = torch.full_like(k_cache, float("nan"))
        table = torch.full((batch, per_seq + 1), -1, dtype=torch.int32, device=dev)
        for b in range(batch):
            for i in range(per_seq):
                page = int(order[b * per_seq + i])
                table[b, i] = page
                k_cache[page] = dense_k[b, i * case.page_size:(i + 1) * case.page_size]
                v_cache[page] = dense_v[b, i * case.page_size:(i + 1) * case.page_size]
    if case.fp8_cache:  # NaN stays NaN
        sk, sv = _cache_scales(case)
        if case.tensor_scales == "seq_head":  # a dense cache: its rows are its sequences
            sk, sv = sk[:, None, :, None], sv[:, None, :, None]
        elif case.tensor_scales == "head":
            sk, sv = sk[:, None], sv[:, None]
        k_cache = quantize_for_cache(k_cache, sk, torch.float8_e4m3fn)
        v_cache = quantize_for_cache(v_cache, sv, torch.float8_e4m3fn)
    k_new = v_new = None
    if case.seqlen_new:
        k_new = rand(batch, case.seqlen_new, case.heads_k, case.head_dim)
        v_new = rand(batch, case.seqlen_new, case.heads_k, case.head_dim)
    return q, k_cache, v_cache, seqlens, table, k_new, v_new


def _cache_scales(case: DecodeCase):
    """An fp8 case's (scale_k, scale_v): the floats, or fixed tensors around them."""
    if case.tensor_scales is None:
        return SCALE_K, SCALE_V
    g = torch.Generator(device="cuda").manual_seed(7)
    shape = (case.heads_k,) if case.tensor_scales == "head" else (len(case.lengths), case.heads_k)
    return tuple(base * (0.5 + torch.rand(shape, generator=g, device="cuda")) for base in (SCALE_K, SCALE_V))


def _kwargs(case: DecodeCase) -> dict:
    scales = dict(zip(("scale_k", "scale_v"), _cache_scales(case))) if case.fp8_cache else {}
    return dict(causal=case.causal, window_size=case.window, **scales)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A cache as raw bytes (compared bit for bit, NaN included; fp8 has no nan_to_num)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


@pytest.fixture(scope="session")
def decode_kernels(request, tmp_path_factory):
    """Every kernel the cases use, compiled in parallel into a fresh disk cache first."""
    from fmha.jit.launch import sm_count
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner
    from fmha.kvcache import decode_problem

    cache_dir = str(tmp_path_factory.mktemp("decode_kernels"))
    os.environ["FMHA_CACHE_DIR"] = cache_dir
    configs = set()
    for i, case in enumerate(CASES):
        q, k, v, seqlens, table, k_new, v_new = _inputs(case, i)
        problem, _ = decode_problem(q, k, v, seqlens, block_table=table, k_new=k_new, v_new=v_new, return_lse=True,
                                    num_splits=case.num_splits, **_kwargs(case))
        configs.add(HopperDecodeRunner(problem).plan(problem, sm_count(q.device)).cfg)
    for spec in DENSE_DECODE:  # as HopperDenseDecodeRunner builds its problem
        problem = _dense_decode_problem(spec)
        configs.add(HopperDecodeRunner(problem).plan(problem, sm_count(problem.device)).cfg)
    workers = request.config.getoption("--gpu-workers") or max(1, (os.cpu_count() or 2) - 1)
    gpu_cases.compile_all(sorted(configs, key=repr), cache_dir, workers)
    return configs


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name() for c in CASES])
def test_decode_matches_the_reference(index, decode_kernels):
    case = CASES[index]
    q, k, v, seqlens, table, k_new, v_new = _inputs(case, index)
    k_ref, v_ref = k.clone(), v.clone()
    out = torch.full(q.shape, float("nan"), dtype=case.dtype, device="cuda")
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda")
    fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, k_new=k_new, v_new=v_new, return_lse=True,
                                out=out, lse=lse, num_splits=case.num_splits, backend="kernel", **_kwargs(case))
    fmha.check_device_errors()  # a valid call raises no flag
    # the reference computes in fp32 and rounds O to the input type once
    want_o, want_lse = fmha.attention_with_kvcache(
        q, k_ref, v_ref, seqlens, block_table=table, k_new=k_new, v_new=v_new, return_lse=True,
        backend="reference", **_kwargs(case))
    want_o = want_o.float()
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.all(out.transpose(1, 2)[empty] == 0)
    finite = ~empty
    if finite.any():
        assert (lse[finite] - want_lse[finite]).abs().max().item() < LSE_TOL
        err = (out.float() - want_o).norm().item() / want_o.norm().item()
        assert err < O_TOL[case.dtype], err
    if case.seqlen_new:  # the appended keys landed where the reference put them, and only there
        assert torch.equal(_bytes(k), _bytes(k_ref))
        assert torch.equal(_bytes(v), _bytes(v_ref))


_ONE_KEY_PAGES = next(i for i, c in enumerate(CASES) if c.page_size == 1 and not c.fp8_cache)


@pytest.mark.parametrize("index", [8, _ONE_KEY_PAGES], ids=["pages16", "pages1"])
def test_bad_lengths_and_block_tables_raise_through_the_device_flag(decode_kernels, index):
    case = CASES[index]  # paged: 16-key pages, 1-key pages
    q, k, v, seqlens, table, _, _ = _inputs(case, 8)
    too_long = seqlens.clone()
    too_long[1] = table.shape[1] * case.page_size + 1  # past what the block table can hold
    fmha.attention_with_kvcache(q, k, v, too_long, block_table=table, backend="kernel")
    with pytest.raises(ValueError, match="cache_seqlens"):
        fmha.check_device_errors()
    bad_table = table.clone()
    bad_table[4, 3] = k.shape[0] + 5  # a page that does not exist, below sequence 4's length
    fmha.attention_with_kvcache(q, k, v, seqlens, block_table=bad_table, backend="kernel")
    with pytest.raises(ValueError, match="block_table"):
        fmha.check_device_errors()
    fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, backend="kernel")
    fmha.check_device_errors()  # the flag was cleared


def test_a_decode_step_replays_from_a_cuda_graph(decode_kernels):
    case = CASES[0]
    q, k, v, seqlens, table, _, _ = _inputs(case, 0)
    out = torch.empty_like(q)

    def step():
        fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, out=out, backend="kernel")

    graph = gpu_cases.capture_graph(step, torch)
    eager = out.clone()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q.copy_(torch.randn_like(q))  # a new query row replays with the new values
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager) and not out.isnan().any()


def test_an_fp8_decode_replays_with_new_scales_in_its_tensors(decode_kernels):
    """Tensor scales are read on the GPU: a captured fp8 decode step replays with whatever the
    scale tensors hold then, and matches the reference at those scales."""
    index = next(i for i, c in enumerate(CASES) if c.tensor_scales == "seq_head" and c.num_splits is None)
    case = CASES[index]
    q, k, v, seqlens, table, _, _ = _inputs(case, index)
    kwargs = _kwargs(case)
    scale_k, scale_v = kwargs.pop("scale_k"), kwargs.pop("scale_v")
    out = torch.empty_like(q)

    def step():
        fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, out=out, scale_k=scale_k,
                                    scale_v=scale_v, backend="kernel", **kwargs)

    graph = gpu_cases.capture_graph(step, torch)
    for factor_k, factor_v in ((1.0, 1.0), (1.7, 0.5)):
        new_k, new_v = scale_k * factor_k, scale_v * factor_v
        scale_k.copy_(new_k)
        scale_v.copy_(new_v)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, scale_k=new_k.clone(),
                                           scale_v=new_v.clone(), backend="reference", **kwargs).float()
        assert not out.isnan().any()
        err = (out.float() - want).norm().item() / want.norm().item()
        assert err < O_TOL[case.dtype], (factor_k, factor_v, err)


DENSE_DECODE = [  # fmha.attention calls with few query rows: served by the decode configuration
    dict(b=2, sq=1, hq=32, hk=8, d=128, sk=1000, causal=True, mask_align="bottom_right"),
    dict(b=2, sq=1, hq=32, hk=8, d=128, sk=1000, causal=True),  # top-left: the row sees key 0 only
    dict(b=1, sq=3, hq=8, hk=8, d=64, sk=20000, causal=False),  # 8 tiles: the keys are split
    dict(b=3, sq=5, hq=16, hk=2, d=128, sk=777, window_size=(64, 0), mask_align="bottom_right"),
    dict(b=1, sq=40, hq=16, hk=4, d=128, sk=3000, causal=True, mask_align="bottom_right"),
]


def _dense_decode_problem(spec):
    """The DecodeProblem a DENSE_DECODE call becomes (``HopperDenseDecodeRunner``)."""
    from fmha.kernels.hopper.decode_runner import dense_decode_problem
    from fmha.validation import validate

    spec = dict(spec)
    b, sq, hq, hk, d, sk = (spec.pop(k) for k in ("b", "sq", "hq", "hk", "d", "sk"))
    q = torch.empty(b, sq, hq, d, dtype=torch.bfloat16, device="cuda")
    k = torch.empty(b, sk, hk, d, dtype=torch.bfloat16, device="cuda")
    return dense_decode_problem(validate(q, k, k, return_lse=True, **spec), return_lse=True)


@pytest.mark.parametrize("spec", DENSE_DECODE, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_dense_calls_with_few_query_rows_run_as_decode(spec, decode_kernels):
    from fmha import backends
    from fmha.kernels.hopper.decode_runner import HopperDenseDecodeRunner

    spec = dict(spec)
    b, sq, hq, hk, d, sk = (spec.pop(k) for k in ("b", "sq", "hq", "hk", "d", "sk"))
    g = torch.Generator(device="cuda").manual_seed(sk)
    q = torch.randn(b, sq, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    backends.clear_cache()
    out = torch.full_like(q, float("nan"))
    lse = torch.full((b, hq, sq), float("nan"), device="cuda")
    fmha.attention(q, k, v, out=out, lse=lse, backend="kernel", **spec)
    assert any(isinstance(r, HopperDenseDecodeRunner) for r in backends._runners.values())
    want_o, want_lse = fmha.attention(q, k, v, return_lse=True, backend="reference", **spec)
    empty = torch.isneginf(want_lse)
    assert not out.isnan().any() and torch.equal(torch.isneginf(lse), empty)
    finite = ~empty
    assert (lse[finite] - want_lse[finite]).abs().max().item() < LSE_TOL
    err = (out.float() - want_o.float()).norm().item() / want_o.float().norm().item()
    assert err < O_TOL[torch.bfloat16], err


def test_a_decode_step_that_appends_replays_from_a_cuda_graph(decode_kernels):
    """A step with k_new/v_new (written into a paged cache) and the LSE captures and replays: the
    append reads nothing back on the host (a sync there would end the capture)."""
    case = CASES[11]
    q, k, v, seqlens, table, k_new, v_new = _inputs(case, 11)
    out = torch.empty_like(q)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32, device="cuda")

    def step():
        fmha.attention_with_kvcache(q, k, v, seqlens, block_table=table, k_new=k_new, v_new=v_new, out=out,
                                    lse=lse, backend="kernel", **_kwargs(case))

    graph = gpu_cases.capture_graph(step, torch)
    eager, eager_lse = out.clone(), lse.clone()
    # where the step writes its new keys: poisoned, so that only a replayed append restores them
    pos = seqlens.long()[:, None] + torch.arange(k_new.shape[1], device="cuda")
    pages, slots = table.long().gather(1, pos // case.page_size), pos % case.page_size
    k[pages, slots] = float("nan")
    v[pages, slots] = float("nan")
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k[pages, slots], k_new) and torch.equal(v[pages, slots], v_new)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    fmha.check_device_errors()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_append_pass_writes_valid_positions_only(dtype):
    """``append_to_cache`` (one launch): a position past the cache, or on a block-table entry that
    is not a page, writes nothing; every other position gets its new key and value."""
    from fmha.kernels.hopper.decode_passes import append_to_cache

    dev = "cuda"
    table = torch.tensor([[1, -1], [2, 3]], dtype=torch.int32, device=dev)  # sequence 0's second page is missing
    k = torch.zeros(4, 16, 1, 2, dtype=dtype, device=dev)
    v = torch.zeros_like(k)
    new = torch.ones(2, 1, 1, 2, dtype=dtype, device=dev)
    append_to_cache(k, v, new, 2 * new, torch.tensor([16, 5], dtype=torch.int32, device=dev), table, 32)
    assert torch.all(k[0] == 0) and torch.all(k[1] == 0)  # nothing through the bad entry, nothing to page 0
    assert torch.all(k[2, 5] == 1) and torch.all(v[2, 5] == 2) and int((k != 0).sum()) == 2
    k = torch.arange(4 * 16 * 2, device=dev).view(4, 16, 1, 2).to(dtype)
    before = k.clone()
    append_to_cache(k, k.clone(), new, new, torch.tensor([40, -3], dtype=torch.int32, device=dev), table, 32)
    assert torch.equal(k, before)  # nothing fits: nothing changes
    dense = torch.zeros(2, 8, 1, 2, dtype=dtype, device=dev)
    three = torch.ones(2, 3, 1, 2, dtype=dtype, device=dev)
    append_to_cache(dense, dense.clone(), three, three, torch.tensor([6, 1], dtype=torch.int32, device=dev), None, 8)
    assert dense[0, :, 0, 0].tolist() == [0] * 6 + [1, 1] and dense[1, :, 0, 0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    # K and V of other head dims, a strided (non-contiguous) new-key view
    kc, vc = torch.zeros(2, 8, 3, 192, dtype=dtype, device=dev), torch.zeros(2, 8, 3, 128, dtype=dtype, device=dev)
    kn = torch.randn(2, 6, 3, 192, device=dev).to(dtype)[:, ::2]
    vn = torch.randn(2, 3, 3, 128, device=dev).to(dtype)
    append_to_cache(kc, vc, kn, vn, torch.tensor([0, 4], dtype=torch.int32, device=dev), None, 8)
    assert torch.equal(kc[0, :3], kn[0]) and torch.equal(kc[1, 4:7], kn[1]) and torch.equal(vc[1, 4:7], vn[1])
    assert not kc[0, 3:].any() and not kc[1, :4].any() and not kc[1, 7:].any()


def test_new_keys_past_the_fp8_range_saturate_on_the_gpu():
    """CUDA's float-to-e4m3 cast gives NaN past 448 where the CPU's saturates: appended keys are
    clamped first, so a large key lands as +-448 on either device (NaN stays NaN)."""
    x = torch.tensor([500.0, -600.0, 448.0, 470.0, float("nan"), 1.0], device="cuda")
    got = quantize_for_cache(x, 0.5, torch.float8_e4m3fn).float().cpu()
    assert got[:4].tolist() == [448.0, -448.0, 448.0, 448.0] and got[4].isnan() and got[5] == 2.0
    got = quantize_for_cache(x, torch.full((6,), 0.5, device="cuda"), torch.float8_e4m3fn).float().cpu()
    assert got[:4].tolist() == [448.0, -448.0, 448.0, 448.0] and got[4].isnan()
