"""The Hopper backend: the dispatcher's view of the kernels (support check, cache key, prepare,
for the forward and the backward) and the host side of a launch (compiling against fake
tensors, per-call arguments)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmha import device_errors
from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_mod_arguments, fake_rows, fake_vector
from fmha.jit.launch import answered_without_launch, fill_empty_lse, mod_tensors, sinks_fp32, sm_count
from fmha.masking import MaskKind, MaskSpec
from fmha.reference import lse_delta, sink_gradient
from fmha.problem import AttentionProblem, KernelOptions
from fmha.work_tiles import kv_work_tile_table, work_tile_table

from . import dq_layout
from .config import (ARCH, HopperBackwardConfig, HopperForwardConfig, decode_config, decode_tile, why_unsupported,
                     why_unsupported_backward, why_unsupported_decode)
from .decode_passes import append_to_cache, compile_split_combine
from .v_staging import stage_v_fp8



class ForwardArgs(NamedTuple):
    """The forward kernel's arguments by name, in ``HopperAttentionForward.__call__``'s order (the
    stream aside): what a launch passes and what ``compile_forward`` fakes. None: absent."""

    mQ: Any = None
    mK: Any = None
    mV: Any = None
    mO: Any = None
    mLSE: Any = None
    mCuSeqlensQ: Any = None
    mCuSeqlensK: Any = None
    mTileTable: Any = None
    mTileCount: Any = None
    mSeqDescriptors: Any = None
    mErrors: Any = None
    mTileCounter: Any = None
    mCacheSeqlens: Any = None
    mBlockTable: Any = None
    mSinks: Any = None
    mModTensors: Any = None
    mBlockLists: Any = None
    max_seqlen_q: Any = None
    scale_log2: Any = None
    output_scale: Any = None
    softcap_factor: Any = None
    window_left: Any = None
    window_right: Any = None
    num_ctas: Any = None
    num_splits: Any = None
    page_size: Any = None


def _fake_arguments(cfg: HopperForwardConfig) -> ForwardArgs:
    """The kernel's arguments with fake tensors: symbolic sizes and strides, head dim static and
    contiguous, rows 16-byte aligned, so that one compiled kernel serves every size."""
    from cutlass import Float32, Int32

    import cutlass
    import cutlass.cute as cute

    in_t, out_t = cutlass_dtype(cfg.dtype), cutlass_dtype(cfg.out_dtype)
    rank = 3 if cfg.varlen else 4
    kv_rank = 3 if cfg.keys_packed else 4  # a KV cache keeps its batch mode
    d = cfg.head_dim
    q = fake_rows(in_t, rank, d)
    k = fake_rows(in_t, kv_rank, d)
    if cfg.v_staged:
        # stage_v_fp8's (B, H_k, D, S_pad): keys contiguous, D static.
        v = cute.runtime.make_fake_tensor(
            in_t, (cute.sym_int(), cute.sym_int(), d, cute.sym_int()),
            stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,), assumed_align=16)
    else:
        v = fake_rows(in_t, kv_rank, cfg.head_dim_v)
    o = fake_rows(out_t, rank, cfg.head_dim_v)
    lse = fake_rows(cutlass.Float32, 2 if cfg.varlen else 3, None, align_bytes=4) if cfg.has_lse else None
    cu_q = cu_k = tiles = count = descriptors = errors = cache_seqlens = block_table = None
    if cfg.cache_lengths:
        cache_seqlens, errors = fake_vector(cutlass.Int32), fake_vector(cutlass.Int32, 1)
    if cfg.page_run:
        block_table = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()),
                                                    stride=(cute.sym_int(), 1), assumed_align=4)
    if cfg.varlen:
        cu_q = fake_vector(cutlass.Int32)
        cu_k = fake_vector(cutlass.Int32) if cfg.keys_packed else None
        tiles = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
        count = fake_vector(cutlass.Int32, 1) if cfg.tiles_on_device else None
        n = cfg.sequence_descriptors
        descriptors = cute.runtime.make_fake_tensor(cutlass.Int64, (cute.sym_int(), n, 16), stride=(16 * n, 16, 1),
                                                    assumed_align=128)
        errors = fake_vector(cutlass.Int32, 1)
    counter = fake_vector(cutlass.Int32, 1) if cfg.claims_tiles else None
    sinks = fake_vector(cutlass.Float32) if cfg.has_sinks else None
    fake_mods, fake_lists = fake_mod_arguments(cfg.mods)
    return ForwardArgs(
        mQ=q, mK=k, mV=v, mO=o, mLSE=lse, mCuSeqlensQ=cu_q, mCuSeqlensK=cu_k, mTileTable=tiles, mTileCount=count,
        mSeqDescriptors=descriptors, mErrors=errors, mTileCounter=counter, mCacheSeqlens=cache_seqlens,
        mBlockTable=block_table, mSinks=sinks, mModTensors=fake_mods, mBlockLists=fake_lists, max_seqlen_q=Int32(1), scale_log2=Float32(1.0),
        output_scale=Float32(1.0), softcap_factor=Float32(1.0) if cfg.softcap else None,
        window_left=Int32(0) if cfg.window_left_bounded else None,
        window_right=Int32(0) if cfg.window_right_bounded else None, num_ctas=Int32(1),
        num_splits=Int32(1) if cfg.split_kv else None, page_size=Int32(16) if cfg.page_run else None)


def block_lists(mods, problem: AttentionProblem, tile_m: int, tile_n: int, transposed: bool = False):
    """A block mask's (counts, indices) at a kernel's tiles (``BlockMask.tile_lists``), broadcast
    to (B, H_q, ...), or None."""
    if mods is None or mods.block_mask is None:
        return None
    counts, indices = mods.block_mask.tile_lists(tile_m, tile_n, transposed)
    b, h = problem.batch, problem.num_heads_q
    return (counts.expand(b, h, *counts.shape[2:]), indices.expand(b, h, *indices.shape[2:]))


def compile_forward(cfg: HopperForwardConfig, extra_options: str = "", kernel_class=None):
    """Compile the forward kernel of ``cfg`` for sm_90a; needs no GPU. ``kernel_class``: a
    subclass of ``HopperAttentionForward`` to build instead (benchmark variants)."""
    from .fwd import HopperAttentionForward

    kernel = (kernel_class or HopperAttentionForward)(cfg)
    return compile_for(ARCH, kernel, *_fake_arguments(cfg), extra_options=extra_options)


class HopperRunner:
    """A compiled kernel plus the per-call argument preparation."""

    def __init__(self, cfg: HopperForwardConfig, compiled: Callable):
        self.cfg = cfg
        self.compiled = compiled

    def __call__(self, problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 sinks=None, mods=None):
        cfg = self.cfg
        m = problem.mask
        if answered_without_launch(problem, out, lse, sinks):
            return
        if cfg.v_staged:
            v = stage_v_fp8(v, cu_seqlens_k if cfg.varlen else None, problem.seqlen_k)
        tiles = count = descriptors = None
        if cfg.varlen:
            # per-sequence TMA descriptors (q, k, v[, o]; 128 bytes each), written by the launch
            descriptors = torch.empty((problem.batch, cfg.sequence_descriptors, 16), dtype=torch.int64,
                                      device=q.device)
            lens_q, lens_k = problem.seqlens_q, problem.seqlens_k
            if cfg.tiles_on_device:  # listed by the launch: room for every tile up to the max length
                capacity = max(problem.batch * -(-problem.seqlen_q // cfg.tile_m), 1)
                tiles = torch.empty((capacity, 2), dtype=torch.int32, device=q.device)
                count = torch.empty(1, dtype=torch.int32, device=q.device)
            else:
                if lens_q is None:  # not read (FusedAttention.execute(check=False)): every tile up to the max
                    lens_q, lens_k = (problem.seqlen_q,) * problem.batch, (problem.seqlen_k,) * problem.batch
                tiles = work_tile_table(lens_q, lens_k, problem.mask, cfg.tile_m, cfg.tile_n, q.device)
        self.compiled(*ForwardArgs(
            mQ=q, mK=k, mV=v, mO=out, mLSE=lse if cfg.has_lse else None,
            mCuSeqlensQ=cu_seqlens_q if cfg.varlen else None,
            mCuSeqlensK=cu_seqlens_k if cfg.varlen else None,
            mTileTable=tiles, mTileCount=count, mSeqDescriptors=descriptors,
            mErrors=device_errors.flag(q.device) if cfg.varlen else None,
            # the claim counter starts at 0 in every launch (ClaimingTileScheduler)
            mTileCounter=torch.zeros(1, dtype=torch.int32, device=q.device) if cfg.claims_tiles else None,
            mSinks=sinks_fp32(sinks) if cfg.has_sinks else None,
            mModTensors=mod_tensors(mods),
            mBlockLists=block_lists(mods, problem, cfg.tile_m, cfg.tile_n),
            max_seqlen_q=problem.seqlen_q,
            scale_log2=problem.softmax_scale_log2,
            output_scale=problem.output_scale,
            softcap_factor=problem.softcap_factor if cfg.softcap else None,
            window_left=m.window_left if cfg.window_left_bounded else None,
            window_right=m.window_right if cfg.window_right_bounded else None,
            num_ctas=sm_count(q.device) if cfg.persistent else 1,
        ))


class DecodePlan(NamedTuple):
    """How one ``attention_with_kvcache`` call runs (``HopperDecodeRunner.plan``)."""

    cfg: HopperForwardConfig
    packed: bool  # a GQA group's query heads share a query tile
    rows: int  # query rows per (batch entry, head) as the kernel sees them
    heads: int  # query heads as the kernel sees them
    splits: int
    mask: MaskSpec


class HopperDecodeRunner:
    """The forward kernel in its decode configurations (``config.decode_config``) for one kind of
    ``attention_with_kvcache`` call: packs a GQA group's query heads into one query tile where the
    tile would otherwise be mostly empty, splits the keys over CTAs where the tiles cannot fill
    the GPU, and merges the splits (``fmha.split_kv``)."""

    def __init__(self, problem):
        self.tile_m, self.tile_n = decode_tile(problem.dtype, problem.head_dim, problem.head_dim_v)
        self._compiled = {}
        self._plans = {}  # a decode loop repeats its problem: plan it once

    def plan(self, problem, num_sms: int) -> DecodePlan:
        from fmha import split_kv

        group = problem.heads_q // problem.heads_k
        # else the query tiles are full without packing; a mixed batch's decodes need it
        packed = group > 1 and (problem.seqlen_q < self.tile_m or problem.packed_q)
        rows, heads = (problem.seqlen_q * group, problem.heads_k) if packed else (problem.seqlen_q, problem.heads_q)
        tiles = problem.batch * heads * -(-rows // self.tile_m)
        m = problem.mask
        span = problem.capacity  # the most keys a query tile visits: the cache, or what the mask leaves of it
        if m.window_left is not None:
            span = min(span, m.window_left + problem.seqlen_q + (m.window_right or 0))
        elif m.kind == MaskKind.WINDOW and not m.bottom_right:
            span = min(span, problem.seqlen_q + m.window_right)
        span = max(span, 1)  # negative window sides can leave nothing
        splits = problem.num_splits or split_kv.choose_num_splits(tiles, num_sms, -(-span // self.tile_n))
        if problem.packed_q:
            splits = 1  # packed queries list their tiles on the GPU, with no split dimension yet
        if (problem.seqlen_q == 1 and m.kind == MaskKind.WINDOW and m.bottom_right and m.window_left is None
                and m.window_right >= 0):
            m = MaskSpec(MaskKind.NONE)  # one bottom-right row sees every key up to the last
        cfg = decode_config(problem.dtype, problem.out_dtype, problem.head_dim, m.kind, m.window_left is not None,
                            m.window_right is not None, m.bottom_right, problem.return_lse, group if packed else 1,
                            splits > 1, problem.page_size, problem.capacity, problem.softcap > 0, problem.has_sinks,
                            problem.head_dim_v, packed_q=problem.packed_q)
        return DecodePlan(cfg, packed, rows, heads, splits, m)

    def __call__(self, problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks=None, cu_seqlens_q=None):
        from fmha import split_kv

        if problem.packed_q:
            return self.run_packed(problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks, cu_seqlens_q)
        b, s_q, h_q, _ = q.shape
        d = v_cache.shape[-1]  # O's head dim
        if b == 0 or s_q == 0 or h_q == 0 or problem.capacity == 0 or problem.num_pages == 0:
            self.answer_empty(problem, q, lengths, out, lse, sinks)
            return
        plan = self.plan_of(problem, q.device)
        kernel = self.load(plan.cfg, compile_forward)
        q_in = split_kv.pack_gqa(q, problem.heads_k) if plan.packed else q
        if problem.page_size:  # the kernel reads the pages as one run of rows
            k_cache = k_cache.flatten(0, 1).unsqueeze(0)
            v_cache = v_cache.flatten(0, 1).unsqueeze(0)
        rows, heads, splits = plan.rows, plan.heads, plan.splits
        if splits > 1:
            o_k = torch.empty((splits * b, rows, heads, d), dtype=torch.float32, device=q.device)
            lse_k = torch.empty((splits * b, heads, rows), dtype=torch.float32, device=q.device)
        elif plan.packed:
            o_k = torch.empty((b, rows, heads, d), dtype=out.dtype, device=q.device)
            lse_k = torch.empty((b, heads, rows), dtype=torch.float32, device=q.device) if lse is not None else None
        else:
            o_k, lse_k = out, lse
        m = plan.mask
        kernel(*ForwardArgs(
            mQ=q_in, mK=k_cache, mV=v_cache, mO=o_k, mLSE=lse_k if plan.cfg.has_lse else None,
            mErrors=device_errors.flag(q.device), mCacheSeqlens=lengths, mBlockTable=block_table,
            mSinks=sinks_fp32(sinks) if plan.cfg.has_sinks else None, max_seqlen_q=rows,
            scale_log2=problem.softmax_scale_log2, output_scale=problem.output_scale,
            softcap_factor=problem.softcap_factor if plan.cfg.softcap else None, window_left=m.window_left,
            window_right=m.window_right, num_ctas=sm_count(q.device),
            num_splits=splits if plan.cfg.split_kv else None,
            page_size=problem.page_size if plan.cfg.page_run else None))
        if splits > 1:  # merged, and unpacked on the way
            from ..common.split_combine import SplitCombineConfig

            combine = self.load(SplitCombineConfig(out.dtype, d, lse is not None), compile_split_combine)
            combine(o_k, lse_k, out, lse, splits, h_q // heads)
        elif plan.packed:
            split_kv.unpack_gqa(o_k, lse_k, s_q, out, lse)

    def run_packed(self, problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks, cu_seqlens_q):
        """A mixed batch: packed query rows (T_q, H_q, D) at ``cu_seqlens_q`` over the cache. A GQA
        group's heads are packed into rows (row t * g + j: token t, head h * g + j), the offsets
        scaled to match on the GPU, and the tiles listed there (nothing is read back)."""
        from fmha import split_kv

        t_q, h_q, _ = q.shape
        if t_q == 0 or h_q == 0 or problem.batch == 0 or problem.capacity == 0 or problem.num_pages == 0:
            self.answer_empty(problem, q, lengths, out, lse, sinks)
            return
        plan = self.plan_of(problem, q.device)
        kernel = self.load(plan.cfg, compile_forward)
        g = h_q // plan.heads
        q_in, cu_in, o_k, lse_k = q, cu_seqlens_q, out, lse
        if g > 1:
            q_in = split_kv.pack_gqa(q[None], plan.heads)[0]
            cu_in = cu_seqlens_q * g
            o_k = torch.empty((t_q * g, plan.heads, out.shape[-1]), dtype=out.dtype, device=q.device)
            lse_k = torch.empty((plan.heads, t_q * g), dtype=torch.float32, device=q.device) if lse is not None else None
        if problem.page_size:  # the kernel reads the pages as one run of rows
            k_cache = k_cache.flatten(0, 1).unsqueeze(0)
            v_cache = v_cache.flatten(0, 1).unsqueeze(0)
        rows = plan.rows  # the longest sequence's rows, as the kernel counts them
        # room for every query tile the offsets can give (clamped to ``rows`` each)
        capacity = max(1, min(problem.batch * -(-rows // plan.cfg.tile_m), -(-t_q * g // plan.cfg.tile_m) + problem.batch))
        tiles = torch.empty((capacity, 2), dtype=torch.int32, device=q.device)
        count = torch.empty(1, dtype=torch.int32, device=q.device)
        descriptors = torch.empty((problem.batch, plan.cfg.sequence_descriptors, 16), dtype=torch.int64,
                                  device=q.device)
        m = plan.mask
        kernel(*ForwardArgs(
            mQ=q_in, mK=k_cache, mV=v_cache, mO=o_k, mLSE=lse_k if plan.cfg.has_lse else None, mCuSeqlensQ=cu_in,
            mTileTable=tiles, mTileCount=count, mSeqDescriptors=descriptors, mErrors=device_errors.flag(q.device),
            mCacheSeqlens=lengths, mBlockTable=block_table, mSinks=sinks_fp32(sinks) if plan.cfg.has_sinks else None,
            max_seqlen_q=rows, scale_log2=problem.softmax_scale_log2, output_scale=problem.output_scale,
            softcap_factor=problem.softcap_factor if plan.cfg.softcap else None, window_left=m.window_left,
            window_right=m.window_right, num_ctas=sm_count(q.device),
            page_size=problem.page_size if plan.cfg.page_run else None))
        if g > 1:
            split_kv.unpack_gqa(o_k[None], None if lse is None else lse_k[None], t_q, out[None],
                                None if lse is None else lse[None])

    def plan_of(self, problem, device) -> DecodePlan:
        plan = self._plans.get(problem)
        if plan is None:
            if len(self._plans) > 1024:
                self._plans.clear()
            plan = self._plans[problem] = self.plan(problem, sm_count(device))
        return plan

    @staticmethod
    def answer_empty(problem, q, lengths, out, lse, sinks) -> None:
        """No query rows, or a cache that holds no key: O = 0, LSE = -inf (or the sink); a
        cache of no positions flags every length above 0."""
        out.zero_()
        if lse is not None:
            fill_empty_lse(lse, sinks)
        if problem.batch and (problem.capacity == 0 or problem.num_pages == 0):  # any length > 0 cannot be held
            from fmha.kernels.common.error_bits import BAD_CACHE_LENGTH

            device_errors.flag(q.device).bitwise_or_((lengths > 0).any().int() * BAD_CACHE_LENGTH)

    def append(self, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity: int) -> None:
        """The call's new keys and values into the cache, before ``__call__`` reads it."""
        append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity)

    def load(self, cfg, compile_fn) -> Callable:
        kernel = self._compiled.get(cfg)
        if kernel is None:
            kernel = self._compiled[cfg] = disk_cache.load_or_compile(cfg, compile_fn)
        return kernel


def served_as_decode(problem: AttentionProblem, options: KernelOptions) -> bool:
    """Whether a dense forward goes through the decode configuration: few query rows per head
    (the query tiles would be mostly empty) and either query heads to pack (GQA) or too few tiles
    to fill the GPU without splitting the keys. Pinned kernel options keep the prefill one."""
    if (problem.device.type != "cuda" or problem.varlen or problem.dtype not in (torch.float16, torch.bfloat16)
            or problem.mods is not None
            or options.tile_m or options.tile_n
            or options.persistent is not None or options.claim_tiles is not None
            or problem.mask.kind not in (MaskKind.NONE, MaskKind.WINDOW) or problem.seqlen_k == 0):
        return False
    if why_unsupported_decode(dense_decode_problem(problem, problem.return_lse)) \
            or problem.seqlen_q >= decode_tile(problem.dtype, problem.head_dim, problem.head_dim_v)[0]:
        return False
    group = problem.num_heads_q // problem.num_heads_k
    tiles = problem.batch * (problem.num_heads_k if group > 1 else problem.num_heads_q)
    return group > 1 or tiles < 0.8 * sm_count(problem.device)


def dense_decode_problem(problem: AttentionProblem, return_lse: bool):
    """A dense forward as decode over a full cache: every sequence holds all S_k keys."""
    from fmha.kvcache import DecodeProblem

    return DecodeProblem(
        batch=problem.batch, seqlen_q=problem.seqlen_q, heads_q=problem.num_heads_q, heads_k=problem.num_heads_k,
        head_dim=problem.head_dim, head_dim_v=problem.head_dim_v, dtype=problem.dtype, out_dtype=problem.out_dtype,
        mask=problem.mask, page_size=0, capacity=problem.seqlen_k, num_pages=problem.batch, seqlen_new=0,
        score_scale=problem.score_scale, output_scale=problem.output_scale, return_lse=return_lse,
        softcap=problem.softcap, has_sinks=problem.has_sinks, device=problem.device)


class HopperDenseDecodeRunner:
    """A dense ``fmha.attention`` call with few query rows, run as decode over a full cache."""

    def __init__(self, problem: AttentionProblem):
        self.decode = HopperDecodeRunner(problem)
        self._lengths = {}

    def lengths(self, batch: int, seqlen_k: int, device) -> torch.Tensor:
        key = (batch, seqlen_k, device)
        lengths = self._lengths.get(key)
        if lengths is None:
            lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
            if not torch.cuda.is_current_stream_capturing():  # filled by the graph's replay only
                if len(self._lengths) >= 64:  # a decode loop's length grows every step
                    self._lengths.clear()
                self._lengths[key] = lengths
        return lengths

    def __call__(self, problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 sinks=None):
        if answered_without_launch(problem, out, lse, sinks):
            return
        decode = dense_decode_problem(problem, lse is not None)
        self.decode(decode, q, k, v, self.lengths(problem.batch, problem.seqlen_k, q.device), None, out, lse,
                    sinks)


class BackwardArgs(NamedTuple):
    """The backward kernel's arguments by name, in ``HopperAttentionBackward.__call__``'s order
    (the stream aside). None: absent."""

    mQ: Any = None
    mK: Any = None
    mV: Any = None
    mdO: Any = None
    mLSE2: Any = None
    mDelta: Any = None
    mdQacc: Any = None
    mdK: Any = None
    mdV: Any = None
    mCuSeqlensQ: Any = None
    mCuSeqlensK: Any = None
    mSeqDescriptors: Any = None
    mErrors: Any = None
    mSemaphores: Any = None
    mTileTable: Any = None
    mTileCount: Any = None
    mModTensors: Any = None
    mBlockLists: Any = None
    max_seqlen_q: Any = None
    max_seqlen_k: Any = None
    scale_log2: Any = None
    out_scale: Any = None
    score_scale: Any = None
    softcap_factor: Any = None
    window_left: Any = None
    window_right: Any = None


def compile_backward(cfg: HopperBackwardConfig, extra_options: str = ""):
    """Compile the backward kernel of ``cfg`` for sm_90a; needs no GPU."""
    import cutlass
    from cutlass import Float32, Int32

    from .bwd import HopperAttentionBackward

    import cutlass.cute as cute

    t = cutlass_dtype(cfg.dtype)
    d = cfg.head_dim
    rank = 3 if cfg.varlen else 4
    q, k, dk = (fake_rows(t, rank, d) for _ in range(3))
    v, do, dv = (fake_rows(t, rank, cfg.head_dim_v) for _ in range(3))
    # read by TMA: rows 16-byte aligned
    lse2, delta = (fake_rows(cutlass.Float32, 3, None, align_bytes=16) for _ in range(2))  # (B or 1, H, S)
    # (B, H, tiles, tile floats) or varlen (H, tiles, tile floats): dq_layout.py
    dq_acc = fake_rows(cutlass.Float32, rank, cfg.tile_m * d)
    cu_q = cu_k = descriptors = errors = semaphores = tiles = count = None
    if cfg.tiles_listed:
        tiles = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
        count = fake_vector(cutlass.Int32, 1) if cfg.tiles_on_device else None
    if cfg.deterministic:
        semaphores = cute.runtime.make_fake_tensor(
            cutlass.Int32, (cute.sym_int(), cute.sym_int(), cute.sym_int()),
            stride=(cute.sym_int(), cute.sym_int(), 1), assumed_align=4)
    if cfg.varlen:
        cu_q = fake_vector(cutlass.Int32)
        cu_k = fake_vector(cutlass.Int32) if cfg.keys_packed else None
        n = cfg.sequence_descriptors
        descriptors = cute.runtime.make_fake_tensor(cutlass.Int64, (cute.sym_int(), n, 16), stride=(16 * n, 16, 1),
                                                    assumed_align=128)
        errors = fake_vector(cutlass.Int32, 1)
    fake_mods, fake_lists = fake_mod_arguments(cfg.mods)
    args = BackwardArgs(
        mQ=q, mK=k, mV=v, mdO=do, mLSE2=lse2, mDelta=delta, mdQacc=dq_acc, mdK=dk, mdV=dv, mCuSeqlensQ=cu_q,
        mCuSeqlensK=cu_k, mSeqDescriptors=descriptors, mErrors=errors, mSemaphores=semaphores, mTileTable=tiles,
        mTileCount=count, mModTensors=fake_mods, mBlockLists=fake_lists, max_seqlen_q=Int32(1), max_seqlen_k=Int32(1), scale_log2=Float32(1.0),
        out_scale=Float32(1.0), score_scale=Float32(1.0), softcap_factor=Float32(1.0) if cfg.softcap else None,
        window_left=Int32(0) if cfg.window_left_bounded else None,
        window_right=Int32(0) if cfg.window_right_bounded else None)
    return compile_for(ARCH, HopperAttentionBackward(cfg), *args, extra_options=extra_options)


def compile_dq_convert(cfg, extra_options: str = ""):
    """Compile the conversion of the fragment-ordered dQ accumulator (``dq_convert.py``) for sm_90a."""
    import cutlass

    from .dq_convert import DqConvert

    rank = 3 if cfg.varlen else 4
    acc = fake_rows(cutlass.Float32, rank, cfg.tile_m * cfg.head_dim)
    dq = fake_rows(cutlass_dtype(cfg.dtype), rank, cfg.head_dim)
    cu_q = fake_vector(cutlass.Int32) if cfg.varlen else None
    return compile_for(ARCH, DqConvert(cfg), acc, dq, cu_q, cutlass.Int32(1), extra_options=extra_options)


def compile_backward_rows(cfg, extra_options: str = ""):
    """Compile the backward's row pass (``kernels/common/backward_rows.py``) for sm_90a."""
    import cutlass

    from ..common.backward_rows import BackwardRows

    rank = 3 if cfg.varlen else 4
    o, do = (fake_rows(cutlass_dtype(cfg.dtype), rank, cfg.head_dim) for _ in range(2))
    lse, dlse, lse2, delta = (fake_rows(cutlass.Float32, rank - 1, None, align_bytes=4) for _ in range(4))
    # (B, H, tiles, tile floats) or varlen (H, tiles, tile floats)
    dq_accum = fake_rows(cutlass.Float32, rank, cfg.dq_tile_m * cfg.dq_head_dim)
    cu_q = fake_vector(cutlass.Int32) if cfg.varlen else None
    return compile_for(ARCH, BackwardRows(cfg), o, do, lse, dlse if cfg.has_dlse else None, lse2, delta, dq_accum,
                       cu_q, cutlass.Float32(1.0), extra_options=extra_options)


class HopperBackwardRunner:
    """The compiled backward plus the passes around it: the row pass before (the LSE in log2 units,
    delta = rowsum(dO * O) - dLSE, the fp32 dQ buffer zeroed) and dQ converted after."""

    def __init__(self, cfg: HopperBackwardConfig, compiled: Callable):
        self.cfg = cfg
        self.compiled = compiled
        self._row_passes = {}
        self._dq_convert = None

    def row_pass(self, has_dlse: bool) -> Callable:
        compiled = self._row_passes.get(has_dlse)
        if compiled is None:
            from ..common.backward_rows import BackwardRowsConfig

            cfg = BackwardRowsConfig(self.cfg.dtype, self.cfg.head_dim_v, self.cfg.varlen, has_dlse, self.cfg.tile_m,
                                     self.cfg.head_dim)
            compiled = self._row_passes[has_dlse] = disk_cache.load_or_compile(cfg, compile_backward_rows)
        return compiled

    def dq_convert(self) -> Callable:
        if self._dq_convert is None:
            from .dq_convert import DqConvertConfig

            self._dq_convert = disk_cache.load_or_compile(DqConvertConfig.of(self.cfg), compile_dq_convert)
        return self._dq_convert

    def dq_accumulator(self, problem: AttentionProblem, q):
        """The fp32 dQ the kernel adds into, in the order of the MMA's fragments (``dq_layout.py``);
        the row pass zeroes it."""
        return dq_layout.allocate(self.cfg, q, problem.batch, problem.num_heads_q, problem.seqlen_q, zeroed=False)

    def __call__(self, problem: AttentionProblem, dout, q, k, v, out, lse, dlse, dq, dk, dv,
                 cu_seqlens_q=None, cu_seqlens_k=None, deterministic: bool = False, sinks=None, dsinks=None,
                 mods=None):
        if problem.total_q == 0 or problem.total_k == 0 or problem.num_heads_q == 0:
            for grad in (dq, dk, dv):
                grad.zero_()
            if dsinks is not None:
                dsinks.copy_(sink_gradient(sinks, lse, lse_delta(out, dout, dlse)))
            return
        m = problem.mask
        lse = lse.contiguous()
        dlse = dlse.contiguous() if dlse is not None else None
        # rows padded to a multiple of 4 for the kernel's TMA loads (the padding is never used)
        rows = lse.shape[-1]
        padded = torch.empty(lse.shape[:-1] + (2, -(-rows // 4) * 4), dtype=torch.float32, device=lse.device)
        lse2, delta = padded.select(-2, 0), padded.select(-2, 1)
        dq_acc = self.dq_accumulator(problem, q)
        delta_scale = problem.score_scale if self.cfg.ds_prescaled else 1.0
        self.row_pass(dlse is not None)(out, dout, lse, dlse, lse2[..., :rows], delta[..., :rows], dq_acc,
                                        cu_seqlens_q if self.cfg.varlen else None, delta_scale)
        if dsinks is not None:  # from the row pass's delta, which carries the delta scale
            dsinks.copy_(sink_gradient(sinks, lse, delta[..., :rows] / delta_scale))
        if self.cfg.varlen:  # (H, T) -> (1, H, T): the kernel reads both layouts as (B, H, S)
            lse2, delta = lse2.unsqueeze(0), delta.unsqueeze(0)
        descriptors = None
        if self.cfg.varlen:
            # per-sequence TMA descriptors (q, k, v, dO[, dK, dV]; 128 bytes each)
            descriptors = torch.empty((problem.batch, self.cfg.sequence_descriptors, 16), dtype=torch.int64,
                                      device=q.device)
        tiles = count = None
        if self.cfg.tiles_on_device:  # listed by the launch: room for every K/V tile of every sequence
            capacity = max(problem.total_k // self.cfg.tile_n + problem.batch, 1)
            tiles = torch.empty((capacity, 2), dtype=torch.int32, device=q.device)
            count = torch.empty(1, dtype=torch.int32, device=q.device)
        elif self.cfg.tiles_listed:
            tiles = kv_work_tile_table(problem.seqlens_q, problem.seqlens_k, problem.mask, self.cfg.tile_m,
                                       self.cfg.tile_n, q.device)
        semaphores = None
        if self.cfg.deterministic:
            # one per (sequence, query head, query tile): the dQ adds' turn (bwd.py)
            m_tiles = -(-problem.seqlen_q // self.cfg.tile_m)
            semaphores = torch.zeros((problem.batch, problem.num_heads_q, m_tiles), dtype=torch.int32,
                                     device=q.device)
        self.compiled(*BackwardArgs(
            mQ=q, mK=k, mV=v, mdO=dout, mLSE2=lse2, mDelta=delta, mdQacc=dq_acc, mdK=dk, mdV=dv,
            mCuSeqlensQ=cu_seqlens_q if self.cfg.varlen else None,
            mCuSeqlensK=cu_seqlens_k if self.cfg.varlen else None, mSeqDescriptors=descriptors,
            mErrors=device_errors.flag(q.device) if self.cfg.varlen else None, mSemaphores=semaphores,
            mTileTable=tiles, mTileCount=count, mModTensors=mod_tensors(mods),
            mBlockLists=block_lists(mods, problem, self.cfg.tile_m, self.cfg.tile_n, transposed=True),
            max_seqlen_q=problem.seqlen_q, max_seqlen_k=problem.seqlen_k,
            scale_log2=problem.softmax_scale_log2, out_scale=problem.output_scale, score_scale=problem.score_scale,
            softcap_factor=problem.softcap_factor if self.cfg.softcap else None,
            window_left=m.window_left if self.cfg.window_left_bounded else None,
            window_right=m.window_right if self.cfg.window_right_bounded else None,
        ))
        self.dq_convert()(dq_acc, dq, cu_seqlens_q if self.cfg.varlen else None, problem.seqlen_q)


class HopperBackend:
    name = "hopper"
    #: compute capabilities this kernel runs on
    capabilities = ((9, 0),)

    def why_unsupported(self, problem: AttentionProblem, options: KernelOptions) -> list:
        return why_unsupported(problem, options)

    def cache_key(self, problem: AttentionProblem, options: KernelOptions):
        if served_as_decode(problem, options):
            return ("decode",) + self.decode_cache_key(problem, options)
        return HopperForwardConfig.from_problem(problem, options)

    def prepare(self, problem: AttentionProblem, options: KernelOptions) -> Callable:
        if served_as_decode(problem, options):
            return HopperDenseDecodeRunner(problem)
        cfg = HopperForwardConfig.from_problem(problem, options)
        return HopperRunner(cfg, disk_cache.load_or_compile(cfg, compile_forward))

    def why_unsupported_decode(self, problem, options: KernelOptions) -> list:
        return why_unsupported_decode(problem)

    def decode_cache_key(self, problem, options: KernelOptions):
        """What the decode runner depends on beyond each call's sizes (its kernels compile lazily,
        and it plans each problem itself)."""
        return (problem.dtype, problem.head_dim)

    def prepare_decode(self, problem, options: KernelOptions) -> HopperDecodeRunner:
        return HopperDecodeRunner(problem)

    def why_unsupported_backward(self, problem: AttentionProblem, options: KernelOptions) -> list:
        return why_unsupported_backward(problem, options)

    def backward_cache_key(self, problem: AttentionProblem, options: KernelOptions):
        return HopperBackwardConfig.from_problem(problem, options)

    def prepare_backward(self, problem: AttentionProblem, options: KernelOptions) -> HopperBackwardRunner:
        cfg = HopperBackwardConfig.from_problem(problem, options)
        return HopperBackwardRunner(cfg, disk_cache.load_or_compile(cfg, compile_backward))
