"""The host side of a Hopper forward launch: the kernel's arguments by name, compiling it against
fake tensors (no GPU needed), and the runner that prepares each call's arguments."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmha import device_errors
from fmha.jit.compile import compile_for, cutlass_dtype, fake_mod_arguments, fake_rows, fake_vector
from fmha.jit.launch import answered_without_launch, mod_tensors, sinks_fp32, sm_count
from fmha.problem import AttentionProblem
from fmha.work_tiles import work_tile_table

from .config import ARCH, HopperForwardConfig
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
    mCacheScales: Any = None
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
    kv_t = cutlass_dtype(cfg.kv_dtype) if cfg.kv_converted else in_t
    q = fake_rows(in_t, rank, d)
    k = fake_rows(kv_t, kv_rank, d)
    if cfg.v_staged:
        # stage_v_fp8's (B, H_k, D, S_pad): keys contiguous, D static.
        v = cute.runtime.make_fake_tensor(
            in_t, (cute.sym_int(), cute.sym_int(), d, cute.sym_int()),
            stride=tuple(cute.sym_int64(divisibility=16) for _ in range(3)) + (1,), assumed_align=16)
    else:
        v = fake_rows(kv_t, kv_rank, cfg.head_dim_v)
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
    # (B, H_k) each, any strides (a broadcast scale has stride 0)
    scales = tuple(cute.runtime.make_fake_tensor(cutlass.Float32, (cute.sym_int(), cute.sym_int()),
                                                 stride=(cute.sym_int64(), cute.sym_int64()), assumed_align=4)
                   for _ in range(2)) if cfg.kv_scale_tensors else None
    fake_mods, fake_lists = fake_mod_arguments(cfg.mods)
    if cfg.select_block:  # (counts, first rows, positions) per (batch, K/V head, query tile, ...)
        fake_lists = tuple(cute.runtime.make_fake_tensor(
            cutlass.Int32, tuple(cute.sym_int() for _ in range(4)),
            stride=tuple(cute.sym_int64() for _ in range(3)) + (1,), assumed_align=4) for _ in range(3))
    return ForwardArgs(
        mQ=q, mK=k, mV=v, mO=o, mLSE=lse, mCuSeqlensQ=cu_q, mCuSeqlensK=cu_k, mTileTable=tiles, mTileCount=count,
        mSeqDescriptors=descriptors, mErrors=errors, mTileCounter=counter, mCacheSeqlens=cache_seqlens,
        mBlockTable=block_table, mSinks=sinks, mCacheScales=scales, mModTensors=fake_mods, mBlockLists=fake_lists, max_seqlen_q=Int32(1), scale_log2=Float32(1.0),
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
