"""The normalized description of one attention call: what validation produces and what the
reference, the dispatcher and the kernels consume. Host side only (no CuTe DSL import here)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Tuple

import torch

from .masking import MaskKind, MaskSpec, row_key_bounds

#: input dtypes the library accepts (docs/semantics.md, "Inputs"); fp32/fp64 run on the reference
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float32, torch.float64)
#: output dtypes of every input dtype; fp8 inputs may also write fp8, fp32/fp64 inputs their own
OUTPUT_DTYPES = (torch.float16, torch.bfloat16)


def output_dtypes_for(in_dtype: torch.dtype) -> tuple:
    if in_dtype in (torch.float32, torch.float64, torch.float8_e4m3fn):
        return OUTPUT_DTYPES + (in_dtype,)
    return OUTPUT_DTYPES


def default_out_dtype(in_dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 inputs give the same dtype out; fp8 inputs give bf16 unless asked otherwise."""
    return torch.bfloat16 if in_dtype == torch.float8_e4m3fn else in_dtype


def accumulate_dtype(in_dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs: the precision the reference computes in and the LSE's dtype
    (an fp64 call's gradients recompute P from its LSE)."""
    return torch.float64 if in_dtype == torch.float64 else torch.float32


def element_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


class ScoreScaling:
    """How a kernel scales what it holds of a score, for a problem with ``score_scale`` (the factor
    of q.k) and ``softcap`` (0: none); shared by ``AttentionProblem`` and the KV cache's problem."""

    @property
    def score_scale_log2(self) -> float:
        """The score scale for exp2-based softmax: exp(x * s) == exp2(x * s * log2(e))."""
        return self.score_scale * math.log2(math.e)

    @property
    def softmax_scale_log2(self) -> float:
        """The factor a kernel's base-2 softmax applies to the score it holds: with softcap it
        holds ``tanh(q.k * score_scale / softcap)``, whose scaled value is ``softcap`` times that;
        else the raw q.k."""
        return self.softcap * math.log2(math.e) if self.softcap else self.score_scale_log2

    @property
    def softcap_factor(self) -> float:
        """What a kernel multiplies the raw q.k by before tanh (softcap only)."""
        return self.score_scale / self.softcap if self.softcap else 1.0


def matmul_flops(kept_triples: int, head_dim: int, head_dim_v: int) -> float:
    """The forward's matmul FLOPs over the kept (head, row, key) triples: Q.K^T (2 * D) and P.V
    (2 * D_v) each."""
    return 2.0 * kept_triples * (head_dim + head_dim_v)


def kept_pairs(seqlen_q: int, seqlen_k: int, mask: MaskSpec) -> int:
    """The (row, key) pairs ``mask`` keeps in one sequence, counted from the row bands."""
    if mask.kind == MaskKind.NONE:
        return seqlen_q * seqlen_k
    rows = torch.arange(seqlen_q, dtype=torch.int64)
    lo, hi = row_key_bounds(
        rows, seqlen_q, seqlen_k, mask.kind, mask.window_left, mask.window_right, mask.bottom_right,
        imin=lambda a, b: torch.clamp(a, max=b) if torch.is_tensor(a) else min(a, b),
        imax=lambda a, b: torch.clamp(a, min=b) if torch.is_tensor(a) else max(a, b),
        compression=mask.compression,
    )
    return int(torch.clamp(hi - lo, min=0).sum())


@dataclass(frozen=True)
class AttentionProblem(ScoreScaling):
    """Everything about a call except the tensors' data.

    Layout conventions (after validation): dense q is (B, S_q, H_q, D), k/v are (B, S_k, H_k, D);
    varlen q is (T_q, H_q, D), k/v (T_k, H_k, D) with cu_seqlens of length B + 1. LSE is
    (B, H_q, S_q) dense, (H_q, T_q) varlen, fp32, natural log.
    """

    # --- static: a change here may need another compiled kernel
    dtype: torch.dtype
    out_dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    num_heads_q: int
    num_heads_k: int
    mask: MaskSpec
    varlen: bool
    return_lse: bool
    # --- sizes (dynamic for kernels: changing them must not recompile)
    batch: int
    seqlen_q: int  # dense: S_q; varlen: max_seqlen_q
    seqlen_k: int  # dense: S_k; varlen: max_seqlen_k
    total_q: int  # dense: B * S_q; varlen: T_q
    total_k: int  # dense: B * S_k; varlen: T_k
    # --- scales (dynamic)
    softmax_scale: float
    scale_q: float = 1.0
    scale_k: float = 1.0
    scale_v: float = 1.0
    inv_scale_o: float = 1.0
    #: logit softcapping: scores become ``softcap * tanh(s / softcap)`` (0: none); the value is
    #: dynamic for kernels, whether it is 0 is not
    softcap: float = 0.0
    #: a per-query-head sink logit joins each row's softmax denominator (the tensor is an argument)
    has_sinks: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # varlen: each sequence's lengths, read from cu_seqlens on the host by validation (schedulers
    # use them to enumerate only the query tiles that exist, costliest first); None when dense
    seqlens_q: Optional[Tuple[int, ...]] = None
    seqlens_k: Optional[Tuple[int, ...]] = None
    #: score_mod / mask_mod / block mask (``fmha.mods.ModsSignature``; the tensors are arguments)
    mods: Optional[object] = None

    @property
    def is_fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def score_scale(self) -> float:
        """Factor applied to q.k before the softmax (natural-log units)."""
        return self.softmax_scale * self.scale_q * self.scale_k

    @property
    def output_scale(self) -> float:
        return self.scale_v * self.inv_scale_o

    def describe(self) -> str:
        kind = "varlen" if self.varlen else "dense"
        return (
            f"{kind} B={self.batch} S_q={self.seqlen_q} S_k={self.seqlen_k} "
            f"H_q={self.num_heads_q} H_k={self.num_heads_k} D={self.head_dim} "
            f"{str(self.dtype).replace('torch.', '')}->{str(self.out_dtype).replace('torch.', '')} "
            f"mask={self.mask.describe()} lse={self.return_lse}"
            + (f" softcap={self.softcap:g}" if self.softcap else "") + (" sinks" if self.has_sinks else "")
            + ("".join(f" {m!r}" for m in (self.mods.score_mod, self.mods.mask_mod) if m is not None)
               + (" block_mask" if self.mods.block_sparse else "") if self.mods is not None else "")
        )

    def flops(self, seqlens_q: Optional[list] = None, seqlens_k: Optional[list] = None,
              kept_triples: Optional[int] = None) -> float:
        """Matmul FLOPs actually required by the mask (4 * kept (i, j) pairs * D per head),
        counted exactly from the row bands; pass the per-sequence lengths for varlen, or the kept
        (head, row, key) triples where mods decide them (``reference.kept_triples_with_mods``)."""
        if kept_triples is None:
            if seqlens_q is None:
                seqlens_q = [self.seqlen_q] * self.batch
                seqlens_k = [self.seqlen_k] * self.batch
            kept_triples = self.num_heads_q * sum(kept_pairs(sq, sk, self.mask) for sq, sk in zip(seqlens_q, seqlens_k))
        return matmul_flops(kept_triples, self.head_dim, self.head_dim_v)


@dataclass(frozen=True)
class KernelOptions:
    """Knobs a caller may pin instead of letting the backend choose (the CLI's --is_persistent,
    --mma_tiler_mn). ``None`` means "backend's choice"."""

    persistent: Optional[bool] = None
    tile_m: Optional[int] = None
    tile_n: Optional[int] = None
    # Causal-like masks and block masks on dense inputs: persistent CTAs claim the tiles one at a time in the
    # one-CTA-per-tile order (True), or not (False: one CTA per tile where the backend would have
    # claimed). None: the backend's choice (it claims when the problem's K/V exceeds half the
    # L2). An explicit ``persistent=True`` keeps the static persistent walk.
    claim_tiles: Optional[bool] = None
    # backward: bitwise-repeatable gradients (no float atomics whose order varies)
    deterministic: bool = False
