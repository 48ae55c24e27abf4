"""What selects a compiled Hopper forward kernel, and the rules that pick it for a problem.

``HopperForwardConfig`` holds what the inputs fix (dtypes, head dim, mask kind, ...) and the
choices the rules below make per problem (tile, schedule, Q buffers, how O is stored). Every
other property of the kernel (K/V ring depth, register budgets, softmax chains, ...) is derived
from those fields here, in one place. Sizes, scales and window lengths are launch arguments: a
new size reuses the compiled kernel. Why each rule is what it is, with the measurements:
docs/performance.md.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from fmha.masking import MaskKind, tile_costs_vary
from fmha.problem import AttentionProblem, KernelOptions, element_bytes, output_dtypes_for

#: the architecture every Hopper kernel is compiled for
ARCH = "sm_90a"
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
#: fp8's head dims (Q, K and V alike); also the decode path's (``why_unsupported_decode``)
SUPPORTED_HEAD_DIMS = (32, 64, 128, 256)
#: 16-bit inputs: Q/K and V head dims each a multiple of ``HEAD_DIM_STEP`` up to ``MAX_HEAD_DIM``
HEAD_DIM_STEP = 16
MAX_HEAD_DIM = 256
# What the scheduling rules assume of the GPU: the L2 of an H100 / H200 (SXM).
L2_BYTES = 50 * 2**20
# Shared memory a CTA may use on SM90 (227 KiB), and what the buffers may take of it (room for
# the mbarriers and alignment).
SMEM_LIMIT = 227 * 1024
SMEM_BYTES = SMEM_LIMIT - 2048
MAX_KV_STAGES = 8
#: the fewest K/V ring stages a key tile is chosen for (``allowed_tiles``)
MIN_KV_STAGES = 4


class Schedule(enum.Enum):
    """How query tiles meet CTAs."""

    #: one CTA per tile; the hardware hands tiles to SMs as they free up
    ONE_CTA_PER_TILE = "one_cta_per_tile"
    #: one CTA per SM, each walking a static list of tiles
    PERSISTENT = "persistent"
    #: one CTA per SM, each claiming its next tile from a counter in global memory
    CLAIMED = "claimed"


class OStore(enum.Enum):
    """How the epilogue writes O."""

    #: from registers, predicated on the sequence length
    DIRECT = "direct"
    #: staged in a shared-memory buffer of its own, then one TMA store
    TMA_OWN_BUFFER = "tma_own_buffer"
    #: staged in the tile's Q buffer (free once the mainloop is done), then one TMA store
    TMA_Q_BUFFER = "tma_q_buffer"


def head_dims_served(dtype: torch.dtype, head_dim: int, head_dim_v: int) -> bool:
    """Whether the forward kernel is built for these Q/K and V head dims: 16-bit inputs take any
    multiples of 16 up to 256 (V's may differ); fp8 ``SUPPORTED_HEAD_DIMS`` with V's equal."""
    if dtype == torch.float8_e4m3fn:
        return head_dim in SUPPORTED_HEAD_DIMS and head_dim_v == head_dim
    return all(x % HEAD_DIM_STEP == 0 and HEAD_DIM_STEP <= x <= MAX_HEAD_DIM for x in (head_dim, head_dim_v))


def allowed_tiles(dtype: torch.dtype, head_dim: int, head_dim_v: int = None) -> tuple:
    """(tile_m, tile_n) shapes the kernel is built for, the default first: 64 query rows per
    consumer warpgroup, the key tile as wide as the registers allow beside O."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if max(head_dim, dv) <= 64:
        return ((192, 128), (128, 128))  # small O leaves registers for a third warpgroup
    if dtype == torch.float8_e4m3fn and head_dim == 256:
        # fp8's P.V reads keys in blocks of 32, and its exact row max rescales O every step:
        # 128 keys a step pay that for more keys than 64
        return ((128, 128), (128, 64))
    if dv <= 128:
        tile_n = 128
    else:
        # a 64 x dv fp32 O takes dv / 2 registers per thread: S (tile_n / 2) and P (tile_n / 4)
        # get what remains of about 190 (D=256: 80 keys, D=192: 112)
        tile_n = min(128, (190 - dv // 2) * 4 // 3 // 16 * 16)
    # a K/V ring stage holds a K or a V tile; fewer than 4 stages beside the Q tile starve the
    # loop (docs/performance.md, head dims)
    while tile_n > 16 and 128 * head_dim * element_bytes(dtype) + MIN_KV_STAGES * tile_n * max(head_dim, dv) * \
            element_bytes(dtype) > SMEM_BYTES:
        tile_n -= 16
    return ((128, tile_n),)


def o_buffer_reserved(dtype: torch.dtype, out_dtype: torch.dtype, varlen: bool, tile_m: int, head_dim_v: int) -> int:
    """Shared memory kept for O's staging buffer before the K/V ring takes the rest: fp8 inputs
    with a 16-bit O (an fp8 ring stays deep enough beside it); not yet for varlen, whose fp8 D=256
    ring was verified at full depth with O stored directly."""
    if dtype == torch.float8_e4m3fn and element_bytes(out_dtype) == 2 and not varlen:
        return tile_m * head_dim_v * 2
    return 0


def kv_stages_for(dtype: torch.dtype, head_dim: int, tile_m: int, tile_n: int, q_stages: int,
                  reserved_bytes: int = 0, head_dim_v: int = None) -> int:
    """K/V ring depth: as many stages as shared memory holds beside the Q tile(s) and
    ``reserved_bytes`` of other buffers (O's, ``o_buffer_reserved``), at most 8. A stage holds a
    K or a V tile, so it is as large as the larger of the two."""
    elem = element_bytes(dtype)
    stage_dim = max(head_dim, head_dim if head_dim_v is None else head_dim_v)
    stages = (SMEM_BYTES - reserved_bytes - q_stages * tile_m * head_dim * elem) // (tile_n * stage_dim * elem)
    return int(max(2, min(MAX_KV_STAGES, stages)))


def converted_ring_stages(head_dim: int, head_dim_v: int, tile_m: int, tile_n: int, q_stages: int) -> tuple:
    """(K/V ring stages, staging ring stages) for a converted fp8 cache under a 16-bit query:
    three 16-bit stages let the converter fill one while the consumers hold K_n and V_n-1, and
    the 8-bit staging ring takes the rest (it keeps the loads in flight)."""
    stage16 = tile_n * max(head_dim, head_dim_v) * 2
    free = SMEM_BYTES - q_stages * tile_m * head_dim * 2
    for stages16 in (3, 2):
        stages8 = min(MAX_KV_STAGES, (free - stages16 * stage16) // (stage16 // 2))
        if stages8 >= 2:
            return stages16, int(stages8)
    return 2, 2  # too large: the kernel's shared-memory check says so


def choose_schedule(problem: AttentionProblem, options: KernelOptions) -> Schedule:
    """Persistent by default. Tiles of differing cost (causal-like masks, block masks) are
    claimed, last query tile first (the longest under causal-like masks), when the problem's K/V
    does not fit half the L2 (balance beats the static walk's L2 reuse there)."""
    m = problem.mask
    uneven = tile_costs_vary(m.kind, m.window_left is not None, problem.mods is not None and problem.mods.block_sparse)
    claimable = uneven and not problem.varlen  # the varlen tile table keeps sequences together
    kv_bytes = (problem.batch * problem.num_heads_k * problem.seqlen_k * problem.head_dim * 2
                * element_bytes(problem.dtype))
    claims = claimable and kv_bytes > L2_BYTES // 2
    if options.persistent is True:
        return Schedule.PERSISTENT  # pinned: the static walk
    if claimable and options.claim_tiles is not None:
        if options.claim_tiles:
            return Schedule.CLAIMED
        if claims:  # the same order without claiming
            return Schedule.ONE_CTA_PER_TILE
    if options.persistent is False:
        return Schedule.ONE_CTA_PER_TILE
    return Schedule.CLAIMED if claims else Schedule.PERSISTENT


def q_stages_for(schedule: Schedule, head_dim: int, seqlen_k: int) -> int:
    """Two Q buffers let a persistent CTA load its next tile during the current one; long rows
    and D=256 need the shared memory for K/V stages instead."""
    persistent = schedule != Schedule.ONE_CTA_PER_TILE
    return 2 if persistent and head_dim <= 128 and seqlen_k <= 4096 else 1


def o_store_for(dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, varlen: bool, unmasked: bool,
                seqlen_k: int, tile_m: int, tile_n: int, q_stages: int, head_dim_v: int = None) -> OStore:
    """TMA stores of O (whole lines) where they measured faster and can work: 16-bit outputs
    only (varlen through each sequence's own descriptor, which stops the box at its end); D <= 64
    rows reading more than 2k keys keep the direct store, which measured faster there."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if element_bytes(out_dtype) != 2 or (dv <= 64 and unmasked and seqlen_k > 2048):
        return OStore.DIRECT
    elem = element_bytes(dtype)
    reserved = o_buffer_reserved(dtype, out_dtype, varlen, tile_m, dv)
    stages = kv_stages_for(dtype, head_dim, tile_m, tile_n, q_stages, reserved, dv)
    used = q_stages * tile_m * head_dim * elem + stages * tile_n * max(head_dim, dv) * elem
    if used + tile_m * dv * 2 <= SMEM_BYTES:
        return OStore.TMA_OWN_BUFFER  # beside a full K/V ring (D <= 64), or kept for it (fp8 inputs)
    # the Q buffer holds the input's type and Q's head dim; another type or width would not fit
    # its swizzle
    return OStore.TMA_Q_BUFFER if out_dtype == dtype and dv == head_dim else OStore.DIRECT


@dataclass(frozen=True)
class HopperForwardConfig:
    """Everything that selects a different compiled Hopper forward kernel."""

    # fixed by the inputs
    dtype: torch.dtype
    out_dtype: torch.dtype
    head_dim: int  # of Q and K
    head_dim_v: int  # of V and O
    mask_kind: MaskKind
    window_left_bounded: bool
    window_right_bounded: bool
    bottom_right: bool
    varlen: bool
    has_lse: bool
    # chosen per problem (``from_problem``)
    tile_m: int
    tile_n: int
    schedule: Schedule
    q_stages: int
    o_store: OStore
    #: varlen with the lengths not read on the host: the tile list is built on the GPU
    tiles_on_device: bool = False
    # ---- decode over a KV cache (``attention_with_kvcache``; see ``decode_config``)
    #: query heads of one K/V head packed as rows of one query tile (row r: position r // this)
    rows_per_query: int = 1
    #: each query tile's keys shared out over ``num_splits`` CTAs, which write fp32 partial O and
    #: LSE for the split-combine pass
    split_kv: bool = False
    #: each sequence's keys are the first ``cache_seqlens[b]`` rows of its cache
    cache_lengths: bool = False
    #: paged K/V (key p of sequence b is row p % page_size of page block_table[b, p // page_size]):
    #: keys per TMA load, gcd(page size, tile_n), so that a load never crosses a page; 0: dense
    page_run: int = 0
    #: the cache's K/V dtype where it differs from Q's (float8_e4m3fn under a 16-bit query): TMA
    #: loads it into a staging ring and converting warps convert it into the K/V ring
    #: (``kv_convert.py``)
    kv_dtype: Optional[torch.dtype] = None
    #: the converted cache's dequantization factors are (B, H_k) fp32 tensors read per work tile
    #: (``scale_k`` into the score scale, ``scale_v`` into the output's), not launch scalars
    kv_scale_tensors: bool = False
    # ---- variants (``common/mask.py``, ``common/softmax.py``)
    #: scores capped at softcap * tanh(s / softcap)
    softcap: bool = False
    #: a sink logit per query head joins each row's softmax denominator
    has_sinks: bool = False
    #: compressed causal's (block, stride); None: derived per sequence (``MaskSpec.compression``)
    compression: Optional[Tuple[int, int]] = None
    #: score_mod / mask_mod / block mask (``fmha.mods.ModsSignature``)
    mods: Optional[object] = None
    #: NSA selection (``selection_config``): keys of this many tokens from each listed block's
    #: first row, kept by the query positions that chose the block; 0: none
    select_block: int = 0

    def __post_init__(self):
        if self.mods is not None and (self.cache_lengths or self.split_kv or self.rows_per_query > 1):
            raise ValueError("score and mask mods are not served by the decode options")
        if self.mods is not None and self.mods.block_sparse and self.varlen:
            raise ValueError("block masks are for dense batches")
        if self.tile_m % 64 or self.tile_n % 16:
            raise ValueError(f"tiles are 64 query rows per warpgroup and 16-key steps, not {self.tile_m}x{self.tile_n}")
        if self.schedule == Schedule.CLAIMED and self.varlen:
            raise ValueError("varlen problems walk their tile table; they do not claim tiles")
        if self.o_store != OStore.DIRECT and element_bytes(self.out_dtype) != 2:
            raise ValueError("O is TMA-stored only with a 16-bit output")
        if self.tiles_on_device and not self.varlen:
            raise ValueError("only varlen problems have a tile list")
        if self.o_store == OStore.TMA_Q_BUFFER and (self.out_dtype != self.dtype or self.head_dim_v != self.head_dim):
            raise ValueError("O staged in the Q buffer must have the input's type and Q's head dim")
        if self.v_staged and self.head_dim_v != self.head_dim:
            raise ValueError("fp8's staged V has Q's head dim")
        if (self.cache_lengths or self.split_kv or self.rows_per_query > 1) and self.dtype == torch.float8_e4m3fn:
            raise ValueError("the decode options take 16-bit inputs")
        if self.varlen and (self.split_kv or (self.rows_per_query > 1 and not self.cache_lengths)):
            raise ValueError("packed queries take GQA packing over a cache only, and no split-KV")
        if self.varlen and self.cache_lengths and not self.tiles_on_device:
            raise ValueError("packed queries over a cache list their tiles on the device (no lengths are read)")
        if self.split_kv and (self.out_dtype != torch.float32 or not self.has_lse):
            raise ValueError("split-KV writes fp32 partial outputs with their LSE")
        if self.kv_dtype is not None and (self.kv_dtype != torch.float8_e4m3fn or element_bytes(self.dtype) != 2
                                          or not self.cache_lengths or self.claims_tiles or self.mods is not None):
            raise ValueError("converted K/V are an fp8 cache under a 16-bit query, on a static or listed tile walk")
        if self.kv_scale_tensors and (self.kv_dtype is None or self.softcap):
            raise ValueError("scale tensors are an fp8 cache's, without softcap (its cap follows the score scale)")
        if self.kv_dtype is not None and self.num_consumer_warpgroups != 1:
            raise ValueError("a converted cache is read by one consumer warpgroup (64-row tiles)")
        if self.select_block and (self.select_block > self.tile_n or self.rows_per_query < 2
                                  or self.tile_m % self.rows_per_query or self.tile_m // self.rows_per_query > 32
                                  or self.varlen or self.cache_lengths or self.split_kv or self.mods is not None
                                  or self.mask_kind != MaskKind.NONE or element_bytes(self.dtype) != 2):
            raise ValueError("selection packs 2..32 query positions' GQA heads in a tile (a divisor of its rows) "
                             "over one dense run of 16-bit keys, each block at most a key tile, without other masks")
        if self.page_run and (not self.cache_lengths or self.tile_n % self.page_run
                              or self.page_run % page_run_quantum(self.head_dim, self.head_dim_v,
                                                                  self.kv_dtype or self.dtype)):
            raise ValueError("a paged cache has lengths per sequence, and loads runs of keys that divide the key tile "
                             "and start 128-byte aligned in shared memory (page_run_quantum)")

    @staticmethod
    def from_problem(problem: AttentionProblem, options: KernelOptions) -> "HopperForwardConfig":
        m = problem.mask
        default_m, default_n = allowed_tiles(problem.dtype, problem.head_dim, problem.head_dim_v)[0]
        tile_m, tile_n = options.tile_m or default_m, options.tile_n or default_n
        schedule = choose_schedule(problem, options)
        q_stages = q_stages_for(schedule, problem.head_dim, problem.seqlen_k)
        return HopperForwardConfig(
            dtype=problem.dtype,
            out_dtype=problem.out_dtype,
            head_dim=problem.head_dim,
            head_dim_v=problem.head_dim_v,
            mask_kind=m.kind,
            window_left_bounded=m.window_left is not None,
            window_right_bounded=m.window_right is not None,
            bottom_right=m.bottom_right if m.kind == MaskKind.WINDOW else False,
            varlen=problem.varlen,
            has_lse=problem.return_lse,
            tile_m=tile_m,
            tile_n=tile_n,
            schedule=schedule,
            q_stages=q_stages,
            o_store=o_store_for(problem.dtype, problem.out_dtype, problem.head_dim, problem.varlen,
                                m.kind == MaskKind.NONE, problem.seqlen_k, tile_m, tile_n, q_stages,
                                problem.head_dim_v),
            tiles_on_device=problem.varlen and problem.seqlens_q is None,
            softcap=problem.softcap > 0,
            has_sinks=problem.has_sinks,
            compression=m.compression,
            mods=problem.mods,
        )

    # ---- derived: one line of reason each
    @property
    def persistent(self) -> bool:
        return self.schedule != Schedule.ONE_CTA_PER_TILE

    @property
    def claims_tiles(self) -> bool:
        return self.schedule == Schedule.CLAIMED

    @property
    def longest_first(self) -> bool:
        """Causal-like masks give later query tiles more keys, so those start first; block
        masks take the same order (it is causal's for a causal mask mod)."""
        return tile_costs_vary(self.mask_kind, self.window_left_bounded, self.mods is not None and self.mods.block_sparse)

    @property
    def kv_converted(self) -> bool:
        return self.kv_dtype is not None

    @property
    def kv_stages(self) -> int:
        if self.kv_converted:
            return converted_ring_stages(self.head_dim, self.head_dim_v, self.tile_m, self.tile_n, self.q_stages)[0]
        reserved = o_buffer_reserved(self.dtype, self.out_dtype, self.varlen, self.tile_m, self.head_dim_v)
        return kv_stages_for(self.dtype, self.head_dim, self.tile_m, self.tile_n, self.q_stages, reserved,
                             self.head_dim_v)

    @property
    def kv_staging_stages(self) -> int:
        """Stages of the converted cache's staging ring (0: K/V are loaded into the K/V ring)."""
        if not self.kv_converted:
            return 0
        return converted_ring_stages(self.head_dim, self.head_dim_v, self.tile_m, self.tile_n, self.q_stages)[1]

    @property
    def converter_warpgroups(self) -> int:
        """Warpgroups after the consumers that only convert a cache (``kv_convert.py``)."""
        return 1 if self.kv_converted else 0

    @property
    def num_consumer_warpgroups(self) -> int:
        return self.tile_m // 64

    @property
    def register_budgets(self) -> tuple:
        """(producer, consumer) registers per thread after ``setmaxnreg``: the totals are what the
        CTA gets at launch (384 threads x 168 = 128 * 24 + 256 * 240; a larger total would leave a
        warpgroup's increase waiting forever)."""
        if self.kv_converted:  # 384 threads: the producer's and the converting warpgroups 56 each, 1 consumer
            return (56, 240)
        return {1: (56, 256), 2: (24, 240), 3: (32, 160)}[self.num_consumer_warpgroups]

    @property
    def softmax_chains(self) -> tuple:
        """(max, sum) chains per softmax row: shorter dependency chains pay where three
        warpgroups leave each little issue slack (D <= 64), and for fp8 under causal-like masks."""
        if self.head_dim <= 64 or (self.dtype == torch.float8_e4m3fn and self.longest_first):
            return (4, 2)
        return (1, 1)

    @property
    def lazy_rescale(self) -> bool:
        """A stale row max (``OnlineSoftmax.max_slack``) skips most O rescales; it pays from
        D=128, and fp8 keeps the exact max, whose probability e4m3 then holds exactly."""
        return element_bytes(self.dtype) == 2 and self.head_dim_v >= 128

    @property
    def v_staged(self) -> bool:
        """fp8: the P.V product needs V key-major; V goes through ``stage_v_fp8`` first."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def o_via_tma(self) -> bool:
        return self.o_store != OStore.DIRECT

    @property
    def sequence_descriptors(self) -> int:
        """Varlen: TMA descriptors per sequence (q, k, v; o where O is TMA-stored)."""
        return 4 if self.o_via_tma else 3

    @property
    def keys_packed(self) -> bool:
        """K and V are packed sequences (varlen without a cache): each sequence's own descriptors."""
        return self.varlen and not self.cache_lengths

    @property
    def kv_load_rows(self) -> int:
        """Keys per TMA load of K or V: the whole tile, or a paged cache's run."""
        return self.page_run or self.tile_n


def page_run_quantum(head_dim: int, head_dim_v: int, kv_dtype: torch.dtype) -> int:
    """The keys a paged load's run must be a multiple of: each run is one TMA box per swizzle
    atom column, whose shared memory address must be 128-byte aligned; an atom column holds
    gcd(128, row bytes) bytes of a key (the swizzle the row's width allows)."""
    size = element_bytes(kv_dtype)
    return max(128 // math.gcd(128, width * size) for width in (head_dim, head_dim_v))


def decode_tile(dtype: torch.dtype, head_dim: int, head_dim_v: int = None,
                kv_dtype: Optional[torch.dtype] = None) -> tuple:
    """Decode's (tile_m, tile_n): the fewest query rows the kernel is built for; 64 over a
    converted cache (``kv_dtype`` not ``dtype``), whose converting warps need the issue slots a
    second consumer warpgroup's (mostly empty) query rows would take."""
    tile_m, tile_n = min(allowed_tiles(dtype, head_dim, head_dim_v))
    return (64 if kv_dtype not in (None, dtype) else tile_m), tile_n


def why_unsupported_decode(problem) -> list:
    """Every reason the decode configuration cannot serve a ``fmha.kvcache.DecodeProblem``."""
    reasons = []
    if problem.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the Hopper decode kernel takes float16/bfloat16 queries, not {problem.dtype}")
    if problem.kv_dtype not in (None, torch.float8_e4m3fn):
        reasons.append(f"the Hopper decode kernel takes caches in the query's dtype or float8_e4m3fn, "
                       f"not {problem.kv_dtype}")
    if not head_dims_served(problem.dtype, problem.head_dim, problem.head_dim_v):
        reasons.append(f"the Hopper decode kernel takes head dims (of q/k and of v) that are multiples of "
                       f"{HEAD_DIM_STEP} up to {MAX_HEAD_DIM}, got {problem.head_dim} and {problem.head_dim_v}")
    elif problem.page_size and problem.page_size % decode_tile(problem.dtype, problem.head_dim)[1] \
            and problem.head_dim == 256:
        # runs shorter than the 80-key tile are not verified on hardware at D=256
        reasons.append("the Hopper decode kernel reads D=256 pages whose size is a multiple of 80 keys, "
                       f"not {problem.page_size}")
    elif problem.page_size:
        kv_dtype = problem.kv_dtype or problem.dtype
        tile_n = decode_tile(problem.dtype, problem.head_dim, problem.head_dim_v, kv_dtype)[1]
        quantum = page_run_quantum(problem.head_dim, problem.head_dim_v, kv_dtype)
        if math.gcd(problem.page_size, tile_n) % quantum:
            reasons.append(f"the Hopper decode kernel loads a {str(kv_dtype)[6:]} cache with head dims "
                           f"{problem.head_dim}/{problem.head_dim_v} in runs of a multiple of {quantum} keys that "
                           f"stay within a page: use a page size that is a multiple of {quantum}, not "
                           f"{problem.page_size}")
    if not (0 < problem.score_scale < float("inf")):
        reasons.append("the Hopper decode kernel needs softmax_scale * scale_q * scale_k to be a positive finite "
                       f"number, got {problem.score_scale}")
    return reasons


def decode_config(dtype: torch.dtype, out_dtype: torch.dtype, head_dim: int, mask_kind: MaskKind,
                  window_left_bounded: bool, window_right_bounded: bool, bottom_right: bool, has_lse: bool,
                  rows_per_query: int, split_kv: bool, page_size: int, capacity: int, softcap: bool = False,
                  has_sinks: bool = False, head_dim_v: int = None, packed_q: bool = False,
                  kv_dtype: Optional[torch.dtype] = None, kv_scale_tensors: bool = False) -> HopperForwardConfig:
    """The forward kernel's configuration for decode (``attention_with_kvcache``, whose masks are
    bottom-right, and dense calls with few query rows): the smallest tile, a persistent walk (the
    next tile's Q and K/V load under the current one), fp32 partials with their LSE under
    split-KV. ``packed_q``: the queries are packed sequences (a mixed batch of prefills and
    decodes), whose tiles the GPU lists. ``kv_dtype``: the cache's, where it is not ``dtype``
    (an fp8 cache, converted in shared memory), with ``kv_scale_tensors`` its scales in tensors."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tile_m, tile_n = decode_tile(dtype, head_dim, head_dim_v, kv_dtype)
    q_stages = q_stages_for(Schedule.PERSISTENT, head_dim, capacity)
    out_dtype = torch.float32 if split_kv else out_dtype
    kv_dtype = None if kv_dtype in (None, dtype) else kv_dtype
    o_store = o_store_for(dtype, out_dtype, head_dim, packed_q, mask_kind == MaskKind.NONE, capacity, tile_m, tile_n,
                          q_stages, head_dim_v)
    if kv_dtype is not None and o_store == OStore.TMA_OWN_BUFFER:
        o_store = OStore.DIRECT  # the staging ring takes O's buffer
    return HopperForwardConfig(
        dtype=dtype, out_dtype=out_dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask_kind=mask_kind,
        window_left_bounded=window_left_bounded, window_right_bounded=window_right_bounded,
        bottom_right=bottom_right and mask_kind == MaskKind.WINDOW, varlen=packed_q, has_lse=has_lse or split_kv,
        tile_m=tile_m, tile_n=tile_n, schedule=Schedule.PERSISTENT, q_stages=q_stages,
        o_store=o_store, tiles_on_device=packed_q, rows_per_query=rows_per_query, split_kv=split_kv, cache_lengths=True,
        page_run=math.gcd(page_size, tile_n) if page_size else 0, kv_dtype=kv_dtype,
        kv_scale_tensors=kv_scale_tensors, softcap=softcap,
        has_sinks=has_sinks,
    )


#: selection's tile: 64 packed query rows (a few positions' GQA heads, whose lists differ) by 64
#: keys (NSA's selection block)
SELECTION_TILE = (64, 64)


def selection_tile_positions(group: int) -> int:
    """Query positions per selection tile of GQA groups of ``group`` heads (0: not served, the
    group does not divide the tile's rows or leaves more positions than a 32-bit visit holds)."""
    rows = SELECTION_TILE[0]
    return rows // group if 2 <= group <= rows and rows % group == 0 and rows // group <= 32 else 0


def selection_config(dtype: torch.dtype, head_dim: int, head_dim_v: int, group: int,
                     select_block: int) -> HopperForwardConfig:
    """The forward kernel's configuration for NSA's selection branch (``fmha.nsa``): the packed
    tokens as one dense sequence whose rows are (position, head of the group) pairs, one K/V head
    per tile, walking each tile's list of selected blocks (``SelectedKvWalk``) with the
    positions that chose each; blocks longer than the key tile come as several entries."""
    tile_m, tile_n = SELECTION_TILE
    q_stages = q_stages_for(Schedule.PERSISTENT, head_dim, 0)
    return HopperForwardConfig(
        dtype=dtype, out_dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, mask_kind=MaskKind.NONE,
        window_left_bounded=False, window_right_bounded=False, bottom_right=False, varlen=False, has_lse=True,
        tile_m=tile_m, tile_n=tile_n, schedule=Schedule.PERSISTENT, q_stages=q_stages,
        o_store=o_store_for(dtype, dtype, head_dim, False, False, 0, tile_m, tile_n, q_stages, head_dim_v),
        rows_per_query=group, select_block=min(select_block, tile_n))


def why_unsupported(problem: AttentionProblem, options: KernelOptions) -> list:
    """Every reason the Hopper kernel cannot run ``problem`` (empty when it can). Device and
    architecture checks are the dispatcher's; this is about the configuration."""
    reasons = []
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    if problem.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"the Hopper kernel supports float16/bfloat16/float8_e4m3fn inputs, not {problem.dtype}")
    out_ok = output_dtypes_for(problem.dtype)
    if problem.out_dtype not in out_ok:
        reasons.append(f"the Hopper kernel writes {'/'.join(map(name, out_ok))} outputs for "
                       f"{problem.dtype} inputs, not {problem.out_dtype}")
    dims_ok = head_dims_served(problem.dtype, problem.head_dim, problem.head_dim_v)
    if not dims_ok:
        if problem.dtype == torch.float8_e4m3fn:
            reasons.append(f"the Hopper kernel's fp8 head dims are {SUPPORTED_HEAD_DIMS} with V's equal to Q's, "
                           f"got {problem.head_dim} and {problem.head_dim_v}")
        else:
            reasons.append(f"the Hopper kernel takes head dims (of q/k and of v) that are multiples of "
                           f"{HEAD_DIM_STEP} up to {MAX_HEAD_DIM}, got {problem.head_dim} and {problem.head_dim_v}")
    if not (problem.score_scale > 0 and problem.score_scale < float("inf")):
        reasons.append("the Hopper kernel needs softmax_scale * scale_q * scale_k to be a positive finite "
                       f"number, got {problem.score_scale}")
    if dims_ok and problem.dtype in SUPPORTED_DTYPES:
        tiles = allowed_tiles(problem.dtype, problem.head_dim, problem.head_dim_v)
        m0, n0 = tiles[0]
        asked = (options.tile_m or m0, options.tile_n or n0)
        if (options.tile_m, options.tile_n) != (None, None) and asked not in tiles:
            reasons.append(
                f"the Hopper kernel's tiles for head dim {problem.head_dim} and {problem.dtype} are "
                f"{' or '.join(f'{m}x{n}' for m, n in tiles)}; got {options.tile_m}x{options.tile_n}")
    return reasons
