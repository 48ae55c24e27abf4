"""The Blackwell backend: the dispatcher's view of the SM100 forward kernel (support check, cache
key, prepare) and the host side of a launch (compiling against fake tensors for sm_100a, per-call
arguments). Compiling needs no GPU; running needs a Blackwell GPU (docs/blackwell.md)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from fmha import device_errors
from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_mod_arguments, fake_rows, fake_vector
from fmha.jit.launch import answered_without_launch, mod_tensors, sinks_fp32, sm_count
from fmha.problem import AttentionProblem, KernelOptions
from fmha.work_tiles import work_tile_table

from .config import ARCH_OF_CAPABILITY, SMEM_LIMIT, BlackwellForwardConfig, why_unsupported


class ForwardArgs(NamedTuple):
    """The kernel's arguments by name, in ``BlackwellAttentionForward.__call__``'s order (the
    stream aside). None: absent."""

    mQ: Any = None
    mK: Any = None
    mV: Any = None
    mO: Any = None
    mLSE: Any = None
    mCuSeqlensQ: Any = None
    mCuSeqlensK: Any = None
    mTileTable: Any = None
    mSeqDescriptors: Any = None
    mErrors: Any = None
    mSinks: Any = None
    mModTensors: Any = None
    max_seqlen_q: Any = None
    scale_log2: Any = None
    output_scale: Any = None
    softcap_factor: Any = None
    window_left: Any = None
    window_right: Any = None
    num_ctas: Any = None


def _fake_arguments(cfg: BlackwellForwardConfig) -> ForwardArgs:
    """The kernel's arguments with fake tensors: symbolic sizes and strides, head dim static and
    contiguous, rows 16-byte aligned, so that one compiled kernel serves every size."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    in_t, out_t = cutlass_dtype(cfg.dtype), cutlass_dtype(cfg.out_dtype)
    rank = 3 if cfg.varlen else 4
    d = cfg.head_dim
    q, k, v = (fake_rows(in_t, rank, d) for _ in range(3))
    o = fake_rows(out_t, rank, d)
    lse = fake_rows(cutlass.Float32, 2 if cfg.varlen else 3, None, align_bytes=4) if cfg.has_lse else None
    cu_q = cu_k = tiles = descriptors = errors = None
    if cfg.varlen:
        cu_q, cu_k = fake_vector(cutlass.Int32), fake_vector(cutlass.Int32)
        tiles = cute.runtime.make_fake_tensor(cutlass.Int32, (cute.sym_int(), 2), stride=(2, 1), assumed_align=4)
        descriptors = cute.runtime.make_fake_tensor(cutlass.Int64, (cute.sym_int(), 3, 16), stride=(48, 16, 1),
                                                    assumed_align=128)
        errors = fake_vector(cutlass.Int32, 1)  # set by the descriptor kernel for bad offsets
    sinks = fake_vector(cutlass.Float32) if cfg.has_sinks else None
    return ForwardArgs(
        mQ=q, mK=k, mV=v, mO=o, mLSE=lse, mCuSeqlensQ=cu_q, mCuSeqlensK=cu_k, mTileTable=tiles,
        mSeqDescriptors=descriptors, mErrors=errors, mSinks=sinks, mModTensors=fake_mod_arguments(cfg.mods)[0],
        max_seqlen_q=Int32(1), scale_log2=Float32(1.0),
        output_scale=Float32(1.0), softcap_factor=Float32(1.0) if cfg.softcap else None,
        window_left=Int32(0) if cfg.window_left_bounded else None,
        window_right=Int32(0) if cfg.window_right_bounded else None, num_ctas=Int32(1))


def compile_forward(cfg: BlackwellForwardConfig, extra_options: str = ""):
    """Compile the forward kernel of ``cfg`` for ``cfg.arch``; needs no GPU."""
    from .fwd import BlackwellAttentionForward

    kernel = BlackwellAttentionForward(cfg)
    compiled = compile_for(cfg.arch, kernel, *_fake_arguments(cfg), extra_options=extra_options)
    smem = kernel.shared_storage.size_in_bytes()
    if smem > SMEM_LIMIT:  # the launch would fail; kv_stages_for must leave room
        raise ValueError(f"the Blackwell kernel for {cfg} needs {smem} bytes of shared memory (limit {SMEM_LIMIT})")
    return compiled


class BlackwellRunner:
    """A compiled kernel plus the per-call argument preparation."""

    def __init__(self, cfg: BlackwellForwardConfig, compiled: Callable):
        self.cfg = cfg
        self.compiled = compiled

    def __call__(self, problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 sinks=None, mods=None):
        cfg = self.cfg
        m = problem.mask
        if answered_without_launch(problem, out, lse, sinks):
            return
        tiles = descriptors = None
        if cfg.varlen:
            descriptors = torch.empty((problem.batch, 3, 16), dtype=torch.int64, device=q.device)
            lens_q, lens_k = problem.seqlens_q, problem.seqlens_k
            if lens_q is None:  # lengths not read on the host: every tile up to the max lengths
                lens_q, lens_k = (problem.seqlen_q,) * problem.batch, (problem.seqlen_k,) * problem.batch
            # one entry per CTA row block (two Q tiles) that holds rows
            tiles = work_tile_table(lens_q, lens_k, problem.mask, cfg.cta_rows, cfg.tile_n, q.device)
        self.compiled(*ForwardArgs(
            mQ=q, mK=k, mV=v, mO=out, mLSE=lse if cfg.has_lse else None,
            mCuSeqlensQ=cu_seqlens_q if cfg.varlen else None,
            mCuSeqlensK=cu_seqlens_k if cfg.varlen else None,
            mTileTable=tiles, mSeqDescriptors=descriptors,
            mErrors=device_errors.flag(q.device) if cfg.varlen else None,
            mSinks=sinks_fp32(sinks) if cfg.has_sinks else None,
            mModTensors=mod_tensors(mods),
            max_seqlen_q=problem.seqlen_q,
            scale_log2=problem.softmax_scale_log2,
            output_scale=problem.output_scale,
            softcap_factor=problem.softcap_factor if cfg.softcap else None,
            window_left=m.window_left if cfg.window_left_bounded else None,
            window_right=m.window_right if cfg.window_right_bounded else None,
            num_ctas=sm_count(q.device) if cfg.persistent else 1,
        ))


class BlackwellBackend:
    name = "blackwell"
    #: compute capabilities this kernel is built for: B200/GB200 (10.0, sm_100a) and B300/GB300
    #: (10.3, sm_103a); the configuration records which (``config.arch_for``)
    capabilities = tuple(ARCH_OF_CAPABILITY)

    def why_unsupported(self, problem: AttentionProblem, options: KernelOptions) -> list:
        return why_unsupported(problem, options)

    def cache_key(self, problem: AttentionProblem, options: KernelOptions):
        return BlackwellForwardConfig.from_problem(problem, options)

    def prepare(self, problem: AttentionProblem, options: KernelOptions) -> BlackwellRunner:
        cfg = BlackwellForwardConfig.from_problem(problem, options)
        return BlackwellRunner(cfg, disk_cache.load_or_compile(cfg, compile_forward))
