"""The host side of a Hopper backward launch: the kernel's named arguments, its compile (and the
row pass's and dQ conversion's) against fake tensors, and ``HopperBackwardRunner``, which runs
the three. The dispatcher's view of it: ``backend.py``."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmha import device_errors
from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_mod_arguments, fake_rows, fake_vector
from fmha.jit.launch import mod_tensors
from fmha.reference import lse_delta, sink_gradient
from fmha.problem import AttentionProblem
from fmha.work_tiles import kv_work_tile_table

from . import dq_layout
from .config import ARCH
from .bwd_config import HopperBackwardConfig
from .forward_runner import block_lists


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
        cu_q, cu_k = fake_vector(cutlass.Int32), fake_vector(cutlass.Int32)
        n = cfg.sequence_descriptors
        descriptors = cute.runtime.make_fake_tensor(cutlass.Int64, (cute.sym_int(), n, 16), stride=(16 * n, 16, 1),
                                                    assumed_align=128)
        errors = fake_vector(cutlass.Int32, 1)
    fake_mods, fake_lists = fake_mod_arguments(cfg.mods)
    if cfg.select_block:  # chunk bases, offsets, masked ends, query tiles; positions (entries, 2); pieces;
        # the fp32 dK and dV of split lists (T, H_k, D)
        fake_lists = tuple(fake_vector(cutlass.Int32) for _ in range(4)) + (cute.runtime.make_fake_tensor(
            cutlass.Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=8), fake_vector(cutlass.Int32),
            fake_rows(cutlass.Float32, 3, d), fake_rows(cutlass.Float32, 3, cfg.head_dim_v))
        if cfg.deterministic:  # each entry's dQ turn; the split lists' dK/dV turns
            fake_lists += (fake_vector(cutlass.Int32), fake_vector(cutlass.Int32))
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


def tile_capacity(total_k: int, batch: int, tile_n: int) -> int:
    """Rows of a varlen backward's K/V tile list: every tile of every sequence fits."""
    return max(total_k // tile_n + batch, 1)


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
                 mods=None, query_lists=None, order=None):
        """``query_lists``: the K/V tiles' query tiles where the caller lists them (NSA selection:
        ``SelectionBackwardVisits``), else the block mask's (``mods``) or none. ``order``: a
        deterministic selection backward's tile list, its count and dQ semaphores
        (``SelectionBackwardOrder``)."""
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
        if order is not None:
            tiles, count = order.tiles, order.count
        elif self.cfg.tiles_on_device:  # listed by the launch: room for every K/V tile of every sequence
            tiles = torch.empty((tile_capacity(problem.total_k, problem.batch, self.cfg.tile_n), 2), dtype=torch.int32,
                                device=q.device)
            count = torch.empty(1, dtype=torch.int32, device=q.device)
        elif self.cfg.tiles_listed:
            tiles = kv_work_tile_table(problem.seqlens_q, problem.seqlens_k, problem.mask, self.cfg.tile_m,
                                       self.cfg.tile_n, q.device)
        semaphores = None
        if order is not None:
            semaphores = order.dq_turns
        elif self.cfg.deterministic:
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
            mBlockLists=query_lists if query_lists is not None else block_lists(
                mods, problem, self.cfg.tile_m, self.cfg.tile_n, transposed=True),
            max_seqlen_q=problem.seqlen_q, max_seqlen_k=problem.seqlen_k,
            scale_log2=problem.softmax_scale_log2, out_scale=problem.output_scale, score_scale=problem.score_scale,
            softcap_factor=problem.softcap_factor if self.cfg.softcap else None,
            window_left=m.window_left if self.cfg.window_left_bounded else None,
            window_right=m.window_right if self.cfg.window_right_bounded else None,
        ))
        self.dq_convert()(dq_acc, dq, cu_seqlens_q if self.cfg.varlen else None, problem.seqlen_q)
