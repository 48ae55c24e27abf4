"""Host glue for the Hopper kernel: what it supports, its compile key, compiling with fake tensors
(so that nothing here needs a GPU) and launching through TVM FFI with torch tensors."""

from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from fmha.masking import MaskKind, later_rows_cost_more
from fmha.problem import AttentionProblem, KernelOptions

from fmha.work_tiles import work_tile_table

from . import L2_BYTES, disk_cache
from .v_staging import stage_v_fp8

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
SUPPORTED_OUT_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
# Shared memory a CTA may use on SM90 (227 KiB), less room for the mbarriers and alignment.
_SMEM_BYTES = 227 * 1024 - 2048
_MAX_KV_STAGES = 8


def _elem_bytes(dtype: torch.dtype) -> int:
    return 1 if dtype == torch.float8_e4m3fn else 2


def allowed_tiles(dtype: torch.dtype, head_dim: int) -> tuple:
    """(tile_m, tile_n) shapes the kernel is built for, the default first.

    64 query rows per consumer warpgroup. Small heads leave registers for a third warpgroup
    (192 rows: S 64 + O <= 32 + P 32 registers per thread fit its 160-register budget). Head dim
    256 keeps a 64x256 fp32 O accumulator (128 registers per thread) live, so the key tile
    shrinks: 80 keys for 16-bit inputs (S 40 registers), 64 for fp8, whose P.V product
    consumes keys in blocks of 32."""
    if head_dim <= 64:
        return ((192, 128), (128, 128))
    if head_dim == 128:
        return ((128, 128),)
    return ((128, 64),) if dtype == torch.float8_e4m3fn else ((128, 80),)


def default_tile(dtype: torch.dtype, head_dim: int) -> tuple:
    return allowed_tiles(dtype, head_dim)[0]


def choose_schedule(problem: AttentionProblem) -> bool:
    """Whether the persistent grid's CTAs claim their tiles (``ClaimingTileScheduler``) instead
    of walking a static order: how the query tiles meet the SMs (measured on the H200,
    docs/PERFORMANCE.md, items 7, 10, 19 and 20). The grid is persistent either way; one CTA per
    tile only runs when a caller pins ``persistent=False``."""
    m = problem.mask
    if not later_rows_cost_more(m.kind, m.window_left is not None):
        return False  # even tile costs: a plain grid-stride walk is balanced
    if problem.varlen:
        # The tile table runs a sequence's heads side by side, so the tiles in flight share a
        # few sequences' K/V: the persistent grid wins (causal varlen 401 vs 371 TFLOP/s).
        return False
    # Uneven costs (causal-like). The static walk deals the tiles out sorted by cost, every
    # head's last query tile first: the best balance, but a head's next tile comes a whole cost
    # level later, after every other head's, so its K/V stays in L2 only if all of the
    # problem's K/V does (GQA 16:2, D=128, 17 MB: 551 vs 541 TFLOP/s at S=2k, 634 vs 613 at
    # 8k). Otherwise CTAs claim the tiles one at a time in the order that keeps the query tile
    # fastest (a head's tiles together, the longest first): 134 MB of K/V, D=128 S=512-2k
    # 345/447/518 vs 317/425/502 for the static walk in L2-sized sections, D=64 S=512/1k 236/296
    # vs 227/272 for the static walk, and from S=8k 1-4% above one CTA per tile (item 20).
    kv_bytes = problem.batch * problem.num_heads_k * problem.seqlen_k * problem.head_dim * 2 * _elem_bytes(
        problem.dtype)
    return kv_bytes > L2_BYTES // 2


def softmax_chains_for(head_dim: int, dtype: torch.dtype = torch.bfloat16, causal_like: bool = False) -> tuple:
    """Independent (max, sum) chains per softmax row. At D <= 64 (192-row tiles: three consumer
    warpgroups of 160 registers each) the shorter dependency chains pay: D=64 S=16k 511-517 vs 490-494
    TFLOP/s in two runs; two warpgroups do not (D=128 S=512 383-386 vs 402-405, long rows
    within 1%). fp8 at D=128 under causal-like masks, where the softmax weighs more against the
    twice faster GEMMs: +1.3..+3.4% in two runs (causal S=4k/8k/16k 725/805/880 and 727/798/863
    vs 708/779/859 and 714/787/852); non-causal -1.5..+0.5%, so it keeps one chain."""
    if head_dim <= 64 or (dtype == torch.float8_e4m3fn and causal_like):
        return (4, 2)
    return (1, 1)


def tma_store_o_for(head_dim: int, unmasked: bool, seqlen_k: int) -> bool:
    """O staged in shared memory and written by TMA (``epilogue.store_o_tma``), or stored from
    registers. Measured on the H200, same-path A/B, 3 rounds (docs/PERFORMANCE.md, item 16): TMA
    wins at D=128 (S=512 409 -> 470 TFLOP/s, causal S<=2k +7-13%) and D=256 (+2-6%), and at
    D=64 for short or masked rows; D=64 rows that read all of 4k keys or more lose 2.5-3% with
    it (484/515/523 vs 471/501/508 TFLOP/s at S=4k/8k/16k), for a reason not found yet. fp8
    at D=128: +1-6%."""
    return not (head_dim <= 64 and unmasked and seqlen_k > 2048)


def kv_stages_for(dtype: torch.dtype, head_dim: int, tile_m: int, tile_n: int, q_stages: int = 1) -> int:
    """K/V ring depth: as many stages as shared memory holds beside the Q tile(s), at most 8."""
    elem = _elem_bytes(dtype)
    stages = (_SMEM_BYTES - q_stages * tile_m * head_dim * elem) // (tile_n * head_dim * elem)
    return int(max(2, min(_MAX_KV_STAGES, stages)))


def q_stages_for(persistent: bool, head_dim: int, seqlen_k: int) -> int:
    """Q buffers. A persistent CTA with two loads the next tile's Q (and, behind it, its first
    K/V tiles) while the current tile still runs, instead of after the current tile's mainloop
    has released its Q: that latency was exposed once per tile. Measured in one run
    (docs/PERFORMANCE.md): S=512 452 vs 402 TFLOP/s (D=128), 341 vs 309 (D=64), S=1k +4-7%,
    S=2k +1-2%; at S=16k the K/V stage it costs weighs more (627 vs 638), so long rows keep one.
    At D=256 a second 64 KB Q would leave two K/V stages; one CTA per tile has no next tile."""
    return 2 if persistent and head_dim <= 128 and seqlen_k <= 4096 else 1


def lazy_rescale_for(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the softmax's max may lag (``OnlineSoftmax.max_slack``). Same-path A/B on the H200
    (docs/PERFORMANCE.md, item 17): it pays at D >= 128 (D=128 S=2k-8k +1..+6%, D=256 +1..+5%)
    and not at D=64 (5 rounds: causal -1..-4%, non-causal within +-2%). fp8 keeps the exact max:
    the max element's probability is then exactly 1, which e4m3 holds exactly; 2^(true max -
    stale max) is rounded to 3 mantissa bits, and on scores a few keys dominate the output's error
    tripled (1.8e-2 vs 6.6e-3 relative L2; 16-bit inputs: 1.9e-3 vs 1.6e-3, at bf16's rounding)."""
    return _elem_bytes(dtype) == 2 and head_dim >= 128


def shape_choices(dtype: torch.dtype, persistent: bool, head_dim: int, seqlen_k: int,
                  causal_like: bool = False) -> dict:
    """The compile-time choices ``HopperConfig.from_problem`` makes from the input type, the grid,
    the head dim, the key length and whether later rows cost more (besides tiles and
    scheduling): ``HopperConfig`` fields by name, so that the compile tests and
    ``scripts/kernel_report.py`` build the kernels the library builds."""
    return dict(softmax_chains=softmax_chains_for(head_dim, dtype, causal_like),
                q_stages=q_stages_for(persistent, head_dim, seqlen_k),
                lazy_rescale=lazy_rescale_for(dtype, head_dim))


@dataclass(frozen=True)
class HopperConfig:
    """Everything that selects a different compiled kernel. Sizes, scales and window values are
    runtime arguments: changing them reuses the compiled kernel."""

    dtype: torch.dtype
    out_dtype: torch.dtype
    head_dim: int
    mask_kind: MaskKind
    window_left_bounded: bool
    window_right_bounded: bool
    bottom_right: bool
    varlen: bool
    has_lse: bool
    persistent: bool
    tile_m: int = 128
    tile_n: int = 128
    # mainloop variants, kept selectable so that benchmarks can measure what each one buys
    overlap: bool = True
    pingpong: bool = True
    # rows of at most this many K/V tiles take the serial mainloop (0: never). Off by default:
    # with the later items the overlapped loop is as fast or faster for short rows too
    # (docs/PERFORMANCE.md, items 6 and 18)
    serial_max_tiles: int = 0
    # causal-like masks on a static persistent grid: walk the tiles cost-sorted in sections of
    # heads whose K/V fit L2 (a benchmark variant since item 20: ``choose_schedule`` claims
    # the tiles where the plain walk would not keep K/V in L2)
    l2_sections: bool = False
    # overlapped loop: rescale O just before the P.V GEMM (under the S GEMM), not after softmax
    rescale_before_pv: bool = False
    # softmax: independent chains per row for the max and the sum; (1, 1): one dependent chain
    softmax_chains: tuple = (1, 1)
    # Q buffers in shared memory (``q_stages_for``)
    q_stages: int = 1
    # overlapped loop: K_n released after the softmax, which keeps ptxas's P.V wait below it
    late_k_release: bool = True
    # masked tiles: per-thread column bit masks (R2P) instead of two compares per score
    mask_bits: bool = True
    # O staged in shared memory (its own buffer or the tile's Q buffer: ``separate_o_buffer``) and
    # written by TMA; fixed-length batches with a 16-bit output only, the kernel stores directly
    # otherwise. ``from_problem`` applies ``tma_store_o_for``.
    tma_store_o: bool = True
    # softmax: a row's max may stay up to 2^8 below the true one (``OnlineSoftmax.max_slack``),
    # so that O is rescaled only on the rare tiles that move it (``lazy_rescale_for``)
    lazy_rescale: bool = False
    # persistent CTAs that claim tiles from a global counter in the one-CTA-per-tile order
    # (``ClaimingTileScheduler``; ``from_problem``)
    claim_tiles: bool = False
    # timing experiments only (``scripts/phase_costs.py``): phases of the consumer's step left
    # out, which makes the output wrong; never set by ``from_problem``
    drop_phases: tuple = ()
    # with ``lazy_rescale``: exponentials against the kept max, alongside the tile's max
    # (``OnlineSoftmax.update_against_kept_max``), P packed into a second fragment. Off: level
    # with the default within the run's noise at D=128 and D=256 (docs/PERFORMANCE.md, item 22)
    speculative_exp: bool = False
    # overlapped loop, 16-bit inputs: 2 = P in two fragments taken in turns (``mainloop_two_p``);
    # without ``speculative_exp`` 23-27% slower under causal masks (item 22)
    p_buffers: int = 1

    @property
    def kv_stages(self) -> int:
        return kv_stages_for(self.dtype, self.head_dim, self.tile_m, self.tile_n, self.q_stages)

    @property
    def separate_o_buffer(self) -> bool:
        """TMA-stored O gets a shared-memory buffer of its own when one fits beside Q and a full
        K/V ring (head dim <= 64, and fp8 inputs: the ring stops at its 8-stage cap); otherwise
        it is staged in the tile's Q buffer, which then stays taken until the store has read it
        (16-bit inputs of the output's type only)."""
        if not self.tma_store_o or self.varlen or self.out_dtype not in SUPPORTED_OUT_DTYPES:
            return False
        elem = _elem_bytes(self.dtype)
        used = (self.q_stages * self.tile_m + self.kv_stages * self.tile_n) * self.head_dim * elem
        return used + self.tile_m * self.head_dim * 2 <= _SMEM_BYTES

    @property
    def v_staged(self) -> bool:
        """fp8: the P.V product needs V key-major; V goes through ``stage_v_fp8`` first."""
        return self.dtype == torch.float8_e4m3fn

    @staticmethod
    def from_problem(problem: AttentionProblem, options: KernelOptions) -> "HopperConfig":
        m = problem.mask
        persistent, claim_tiles = True, choose_schedule(problem)
        if options.persistent is not None:
            persistent, claim_tiles = options.persistent, False
        causal_like = later_rows_cost_more(m.kind, m.window_left is not None)
        claimable = not problem.varlen and causal_like
        if claimable and options.claim_tiles is not None and options.persistent is not True:
            if options.claim_tiles:
                persistent, claim_tiles = True, True
            elif claim_tiles:  # the same order without claiming: one CTA per tile
                persistent, claim_tiles = False, False
        tile_m, tile_n = default_tile(problem.dtype, problem.head_dim)
        return HopperConfig(
            dtype=problem.dtype,
            out_dtype=problem.out_dtype,
            head_dim=problem.head_dim,
            mask_kind=m.kind,
            window_left_bounded=m.window_left is not None,
            window_right_bounded=m.window_right is not None,
            bottom_right=m.bottom_right if m.kind == MaskKind.WINDOW else False,
            varlen=problem.varlen,
            has_lse=problem.return_lse,
            persistent=bool(persistent),
            tile_m=options.tile_m or tile_m,
            tile_n=options.tile_n or tile_n,
            claim_tiles=claim_tiles,
            tma_store_o=tma_store_o_for(problem.head_dim, m.kind == MaskKind.NONE, problem.seqlen_k),
            **shape_choices(problem.dtype, bool(persistent), problem.head_dim, problem.seqlen_k, causal_like),
        )


def why_unsupported(problem: AttentionProblem, options: KernelOptions) -> list[str]:
    """Every reason the Hopper kernel cannot run ``problem`` (empty when it can). Device and
    architecture checks are the dispatcher's; this is about the configuration."""
    reasons = []
    if problem.dtype not in SUPPORTED_DTYPES:
        reasons.append(
            f"the Hopper kernel supports float16/bfloat16/float8_e4m3fn inputs, not {problem.dtype}"
        )
    out_ok = SUPPORTED_OUT_DTYPES + ((torch.float8_e4m3fn,) if problem.dtype == torch.float8_e4m3fn else ())
    if problem.out_dtype not in out_ok:
        reasons.append(
            f"the Hopper kernel writes {'/'.join(str(t).replace('torch.', '') for t in out_ok)} "
            f"outputs for {problem.dtype} inputs, not {problem.out_dtype}")
    if problem.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(
            f"the Hopper kernel supports head dims {SUPPORTED_HEAD_DIMS}, got {problem.head_dim}"
        )
    if problem.head_dim_v != problem.head_dim:
        reasons.append("the Hopper kernel needs the head dim of v equal to that of q/k")
    if not (problem.score_scale > 0 and math.isfinite(problem.score_scale)):
        reasons.append(
            "the Hopper kernel needs softmax_scale * scale_q * scale_k to be a positive finite "
            f"number, got {problem.score_scale}"
        )
    if problem.head_dim in SUPPORTED_HEAD_DIMS and problem.dtype in SUPPORTED_DTYPES:
        tiles = allowed_tiles(problem.dtype, problem.head_dim)
        m0, n0 = tiles[0]
        asked = (options.tile_m or m0, options.tile_n or n0)
        if (options.tile_m, options.tile_n) != (None, None) and asked not in tiles:
            reasons.append(
                f"the Hopper kernel's tiles for head dim {problem.head_dim} and {problem.dtype} are "
                f"{' or '.join(f'{m}x{n}' for m, n in tiles)}; got {options.tile_m}x{options.tile_n}"
            )
    return reasons


def torch_to_cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
    }[dtype]


def _fake_tensors(cfg: HopperConfig):
    """Fake tensors with symbolic sizes and strides (head dim static and contiguous, rows 16-byte
    aligned): one compiled kernel then serves every size."""
    import cutlass
    import cutlass.cute as cute

    in_t = torch_to_cutlass_dtype(cfg.dtype)
    out_t = torch_to_cutlass_dtype(cfg.out_dtype)

    def tensor(dtype, rank, static_last: Optional[int], align_elems: int):
        shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (
            (static_last,) if static_last is not None else (cute.sym_int(),)
        )
        stride = tuple(cute.sym_int64(divisibility=align_elems) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(
            dtype, shape, stride=stride, assumed_align=max(1, align_elems * dtype.width // 8)
        )

    rank = 3 if cfg.varlen else 4
    d = cfg.head_dim
    q = tensor(in_t, rank, d, 128 // in_t.width)
    k = tensor(in_t, rank, d, 128 // in_t.width)
    if cfg.v_staged:
        # stage_v_fp8's (B, H_k, D, S_pad): keys contiguous, D static.
        v = cute.runtime.make_fake_tensor(
            in_t, (cute.sym_int(), cute.sym_int(), d, cute.sym_int()),
            stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,), assumed_align=16)
    else:
        v = tensor(in_t, rank, d, 128 // in_t.width)
    o = tensor(out_t, rank, d, 128 // out_t.width)
    lse = tensor(cutlass.Float32, 2 if cfg.varlen else 3, None, 1) if cfg.has_lse else None
    cu_q = cu_k = tiles = descs = None
    if cfg.varlen:
        cu_q = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        cu_k = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)
        tiles = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
        descs = cute.runtime.make_fake_tensor(cutlass.Int64, (cute.sym_int(), 3, 16), stride=(48, 16, 1),
                                              assumed_align=128)
    counter = cute.runtime.make_fake_tensor(cutlass.Int32, (1,), stride=(1,), assumed_align=4) \
        if cfg.claim_tiles else None
    return q, k, v, o, lse, cu_q, cu_k, tiles, descs, counter


@contextlib.contextmanager
def _targeting_sm90a():
    """Make the DSL emit sm_90a code for this compile. Without a GPU it would target its default
    (sm_100a); the package sets CUTE_DSL_ARCH, but only if it is imported before the DSL."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    previous = envar.arch
    if previous.startswith("sm_90"):
        yield
        return
    envar.arch = "sm_90a"
    try:
        yield
    finally:
        envar.arch = previous


def compile_kernel(cfg: HopperConfig, extra_options: str = ""):
    """Compile for sm_90a; works without a GPU (fake tensors, TVM FFI environment stream)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .fwd import HopperAttentionForward

    # The kernel's parameters are config attributes of the same name (fields or properties).
    params = inspect.signature(HopperAttentionForward.__init__).parameters
    kernel = HopperAttentionForward(**{name: getattr(cfg, name) for name in params if name != "self"})
    q, k, v, o, lse, cu_q, cu_k, tiles, descs, counter = _fake_tensors(cfg)
    with _targeting_sm90a():
        return cute.compile(
            kernel,
            q, k, v, o, lse, cu_q, cu_k, tiles, descs, counter,
            Int32(1),  # max_seqlen_q
            Float32(1.0),  # scale_log2
            Float32(1.0),  # output_scale
            Int32(0) if cfg.window_left_bounded else None,
            Int32(0) if cfg.window_right_bounded else None,
            Int32(1),  # num_ctas
            cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
            options=("--enable-tvm-ffi " + extra_options).strip(),
        )


_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


@contextlib.contextmanager
def persistent_grid_of(num_ctas: int, device_index: int):
    """Persistent launches on ``device_index`` use ``num_ctas`` CTAs inside the block (the GPU
    check and the sanitizer cases: a small grid makes every CTA run, and claim, several tiles
    of a small problem); the SM count is looked up again afterwards."""
    _SM_COUNT[device_index] = num_ctas
    try:
        yield
    finally:
        _SM_COUNT.pop(device_index, None)


class HopperRunner:
    """A compiled kernel plus the per-call argument preparation."""

    def __init__(self, cfg: HopperConfig, compiled: Callable):
        self.cfg = cfg
        self.compiled = compiled

    def __call__(self, problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None):
        cfg = self.cfg
        m = problem.mask
        # Nothing to launch: no query rows (a zero-size grid is not a launch), or no keys at all
        # (a TMA descriptor needs a non-empty tensor), where SPEC.md's answer is O = 0, LSE = -inf.
        if problem.total_q == 0 or problem.num_heads_q == 0:
            return
        if problem.total_k == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return
        num_ctas = sm_count(q.device) if cfg.persistent else 1
        if cfg.v_staged:
            v = stage_v_fp8(v, cu_seqlens_k if cfg.varlen else None, problem.seqlen_k)
        tiles = descs = None
        if cfg.varlen:
            # per-sequence TMA descriptors (q, k, v; 128 bytes each), written by the launch
            descs = torch.empty((problem.batch, 3, 16), dtype=torch.int64, device=q.device)
            lens_q, lens_k = problem.seqlens_q, problem.seqlens_k
            if lens_q is None:  # lengths not read on the host: every tile up to the max lengths
                lens_q, lens_k = (problem.seqlen_q,) * problem.batch, (problem.seqlen_k,) * problem.batch
            tiles = work_tile_table(lens_q, lens_k, problem.mask, cfg.tile_m, cfg.tile_n, q.device)
        self.compiled(
            q, k, v, out, lse if cfg.has_lse else None,
            cu_seqlens_q if cfg.varlen else None,
            cu_seqlens_k if cfg.varlen else None,
            tiles,
            descs,
            # the claim counter starts at 0 in every launch (ClaimingTileScheduler)
            torch.zeros(1, dtype=torch.int32, device=q.device) if cfg.claim_tiles else None,
            problem.seqlen_q,
            problem.score_scale_log2,
            problem.output_scale,
            m.window_left if cfg.window_left_bounded else None,
            m.window_right if cfg.window_right_bounded else None,
            num_ctas,
        )


class HopperBackend:
    name = "hopper"

    def why_unsupported(self, problem: AttentionProblem, options: KernelOptions) -> list[str]:
        return why_unsupported(problem, options)

    def cache_key(self, problem: AttentionProblem, options: KernelOptions):
        return (self.name, HopperConfig.from_problem(problem, options))

    def prepare(self, problem: AttentionProblem, options: KernelOptions) -> HopperRunner:
        cfg = HopperConfig.from_problem(problem, options)
        return HopperRunner(cfg, disk_cache.load_or_compile(cfg, compile_kernel))
