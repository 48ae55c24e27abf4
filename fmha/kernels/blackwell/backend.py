"""The Blackwell backend: the dispatcher's view of the SM100 forward kernel (support check, cache
key, prepare) and the host side of a launch (compiling against fake tensors for sm_100a, per-call
arguments). Compiling needs no GPU; running needs a Blackwell GPU (docs/blackwell.md)."""

from __future__ import annotations

from typing import Callable

import torch

from fmha import device_errors
from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_rows, fake_vector
from fmha.jit.launch import answered_without_launch, sinks_fp32, sm_count
from fmha.problem import AttentionProblem, KernelOptions
from fmha.work_tiles import work_tile_table

from .config import ARCH_OF_CAPABILITY, SMEM_LIMIT, BlackwellForwardConfig, why_unsupported


def _fake_arguments(cfg: BlackwellForwardConfig) -> tuple:
    """The kernel's tensor arguments as fake tensors: symbolic sizes and strides, head dim
    static and contiguous, rows 16-byte aligned, so that one compiled kernel serves every size."""
    import cutlass
    import cutlass.cute as cute

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
    return q, k, v, o, lse, cu_q, cu_k, tiles, descriptors, errors, sinks


def compile_forward(cfg: BlackwellForwardConfig, extra_options: str = ""):
    """Compile the forward kernel of ``cfg`` for ``cfg.arch``; needs no GPU."""
    from cutlass import Float32, Int32

    from .fwd import BlackwellAttentionForward

    kernel = BlackwellAttentionForward(cfg)
    compiled = compile_for(
        cfg.arch, kernel, *_fake_arguments(cfg),
        Int32(1),  # max_seqlen_q
        Float32(1.0),  # scale_log2
        Float32(1.0),  # output_scale
        Float32(1.0) if cfg.softcap else None,  # softcap_factor
        Int32(0) if cfg.window_left_bounded else None,
        Int32(0) if cfg.window_right_bounded else None,
        Int32(1),  # num_ctas
        extra_options=extra_options,
    )
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
                 sinks=None):
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
        self.compiled(
            q, k, v, out, lse if cfg.has_lse else None,
            cu_seqlens_q if cfg.varlen else None,
            cu_seqlens_k if cfg.varlen else None,
            tiles,
            descriptors,
            device_errors.flag(q.device) if cfg.varlen else None,
            sinks_fp32(sinks) if cfg.has_sinks else None,
            problem.seqlen_q,
            problem.softmax_scale_log2,
            problem.output_scale,
            problem.softcap_factor if cfg.softcap else None,
            m.window_left if cfg.window_left_bounded else None,
            m.window_right if cfg.window_right_bounded else None,
            sm_count(q.device) if cfg.persistent else 1,
        )


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
