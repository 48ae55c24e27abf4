"""What selects a compiled Blackwell (SM100) forward kernel, and the rules behind it.

``BlackwellForwardConfig`` holds what the inputs fix (dtypes, head dim, mask kind, ...) and the
one choice made per problem (persistent or not). Everything else (tile shape, ring depth,
TMEM columns, register budgets) is derived here, each with its reason. Sizes, scales and window
lengths are launch arguments: a new size reuses the compiled kernel. docs/blackwell.md draws the
kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from fmha.masking import MaskKind, tile_costs_vary
from fmha.problem import AttentionProblem, KernelOptions, element_bytes, output_dtypes_for

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)
SUPPORTED_HEAD_DIMS = (32, 64, 128)
#: tensor memory of one SM: 512 columns of 128 lanes x 32 bits
TMEM_COLUMNS = 512
#: query rows per softmax warpgroup (one tcgen05 MMA's M: a TMEM lane per row)
TILE_M = 128
#: keys per K/V tile (the S tile's TMEM columns)
TILE_N = 128
#: Q tiles per CTA, one per softmax warpgroup
Q_TILES = 2
# Shared memory a CTA may use on SM100 (227 KiB), less room for the mbarriers and alignment.
SMEM_LIMIT = 227 * 1024
SMEM_BYTES = SMEM_LIMIT - 2048
#: the architecture each supported compute capability needs: ``a`` (arch-specific) code runs on
#: exactly one capability, so a B300 (10.3) needs its own sm_103a build
ARCH_OF_CAPABILITY = {(10, 0): "sm_100a", (10, 3): "sm_103a"}


def arch_for(device) -> str:
    """The architecture to compile for ``device``: its own where it is a Blackwell GPU, else sm_100a
    (compiling on a machine without one, as the tests do)."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return ARCH_OF_CAPABILITY.get(torch.cuda.get_device_capability(device), "sm_100a")
    return "sm_100a"


def tmem_columns_needed(head_dim: int) -> int:
    """S (fp32, TILE_N columns; P and the softmax's row statistics live inside it) and O (fp32,
    head_dim columns) for each of the two Q tiles."""
    return Q_TILES * (TILE_N + head_dim)


def kv_stages_for(dtype: torch.dtype, head_dim: int, out_dtype: torch.dtype) -> int:
    """K/V ring depth: as many stages as shared memory holds beside the two Q tiles and the two
    O staging tiles, 2 to 8."""
    elem = element_bytes(dtype)
    fixed = Q_TILES * TILE_M * head_dim * (elem + element_bytes(out_dtype))
    stages = (SMEM_BYTES - fixed) // (TILE_N * head_dim * elem)
    return int(max(2, min(8, stages)))


@dataclass(frozen=True)
class BlackwellForwardConfig:
    """Everything that selects a different compiled Blackwell forward kernel."""

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
    arch: str = "sm_100a"
    # ---- variants (``common/mask.py``, ``common/softmax.py``)
    #: scores capped at softcap * tanh(s / softcap)
    softcap: bool = False
    #: a sink logit per query head joins each row's softmax denominator
    has_sinks: bool = False
    #: compressed causal's (block, stride); None: derived per sequence (``MaskSpec.compression``)
    compression: Optional[Tuple[int, int]] = None
    #: score_mod / mask_mod (``fmha.mods.ModsSignature``; block masks are the Hopper kernels')
    mods: Optional[object] = None

    def __post_init__(self):
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"the Blackwell kernel is built for head dims {SUPPORTED_HEAD_DIMS}, not {self.head_dim}")
        if tmem_columns_needed(self.head_dim) > TMEM_COLUMNS:
            raise ValueError(f"S and O of two Q tiles need {tmem_columns_needed(self.head_dim)} TMEM columns")
        if self.arch not in ARCH_OF_CAPABILITY.values():
            raise ValueError(f"the Blackwell kernel is built for {sorted(ARCH_OF_CAPABILITY.values())}, not {self.arch}")

    @staticmethod
    def from_problem(problem: AttentionProblem, options: KernelOptions) -> "BlackwellForwardConfig":
        m = problem.mask
        return BlackwellForwardConfig(
            dtype=problem.dtype,
            out_dtype=problem.out_dtype,
            head_dim=problem.head_dim,
            mask_kind=m.kind,
            window_left_bounded=m.window_left is not None,
            window_right_bounded=m.window_right is not None,
            bottom_right=m.bottom_right if m.kind == MaskKind.WINDOW else False,
            varlen=problem.varlen,
            has_lse=problem.return_lse,
            # persistent unless asked otherwise: the TMEM allocation and barrier set-up are paid once per SM
            persistent=options.persistent is not False,
            arch=arch_for(problem.device),
            softcap=problem.softcap > 0,
            has_sinks=problem.has_sinks,
            compression=m.compression,
            mods=problem.mods,
        )

    # ---- derived: one line of reason each
    tile_m = TILE_M
    tile_n = TILE_N
    #: query rows per CTA: the trip count and row bands are computed for all of them at once
    cta_rows = Q_TILES * TILE_M

    #: tcgen05 MMAs read V MN-major in every input dtype, fp8 included: V is never re-laid out
    #: (``common.sequence_descriptors`` reads this)
    v_staged = False

    @property
    def kv_stages(self) -> int:
        return kv_stages_for(self.dtype, self.head_dim, self.out_dtype)

    @property
    def longest_first(self) -> bool:
        """Causal-like masks give later query tiles more keys: start those first."""
        return tile_costs_vary(self.mask_kind, self.window_left_bounded)

    @property
    def tmem_columns(self) -> int:
        """The allocation is a power of two of at least 32 columns; S0, S1, O0, O1 in order."""
        need = tmem_columns_needed(self.head_dim)
        cols = 32
        while cols < need:
            cols *= 2
        return cols

    @property
    def o_via_tma(self) -> bool:
        """TMA stores clip at the tensor's end only, not at a packed sequence's: varlen O is
        written from registers, predicated on the sequence length."""
        return not self.varlen


#: registers per thread after ``setmaxnreg`` (one budget per warpgroup): the softmax warpgroups
#: hold a row of 128 fp32 scores plus a 16-key chunk of its P and the exponentials in flight; the
#: correction warpgroup 16 columns of O at a time; the fourth warpgroup (load, MMA, epilogue, idle
#: warps) the MMA warp's operand descriptors and pipeline states. 2 x 128 x 184 + 128 x 80 + 128 x 64
#: = 65536, the register file.
REGISTERS_SOFTMAX = 184
REGISTERS_CORRECTION = 80
REGISTERS_OTHER = 64


def why_unsupported(problem: AttentionProblem, options: KernelOptions) -> list:
    """Every reason the Blackwell kernel cannot run ``problem`` (empty when it can). Device and
    architecture checks are the dispatcher's; this is about the configuration."""
    reasons = []
    name = lambda t: str(t).replace("torch.", "")  # noqa: E731
    if problem.dtype not in SUPPORTED_DTYPES:
        reasons.append(f"the Blackwell kernel supports float16/bfloat16/float8_e4m3fn inputs, not {problem.dtype}")
    out_ok = output_dtypes_for(problem.dtype)
    if problem.out_dtype not in out_ok:
        reasons.append(f"the Blackwell kernel writes {'/'.join(map(name, out_ok))} outputs for "
                       f"{problem.dtype} inputs, not {problem.out_dtype}")
    if problem.head_dim == 256:
        reasons.append("the Blackwell kernel does not serve head dim 256: S and O of its two 128-row Q tiles "
                       f"would need {tmem_columns_needed(256)} of the {TMEM_COLUMNS} TMEM columns")
    elif problem.head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"the Blackwell kernel supports head dims {SUPPORTED_HEAD_DIMS}, got {problem.head_dim}")
    if problem.head_dim_v != problem.head_dim:
        reasons.append("the Blackwell kernel needs the head dim of v equal to that of q/k")
    if not (problem.score_scale > 0 and problem.score_scale < float("inf")):
        reasons.append("the Blackwell kernel needs softmax_scale * scale_q * scale_k to be a positive finite "
                       f"number, got {problem.score_scale}")
    if options.tile_m is not None or options.tile_n is not None:
        if (options.tile_m or TILE_M * Q_TILES, options.tile_n or TILE_N) != (TILE_M * Q_TILES, TILE_N):
            reasons.append(f"the Blackwell kernel's tile is {TILE_M * Q_TILES}x{TILE_N} (two 128-row Q tiles); "
                           f"got {options.tile_m}x{options.tile_n}")
    if options.claim_tiles:
        reasons.append("the Blackwell kernel walks tiles statically; it does not claim them (claim_tiles=True)")
    if problem.mods is not None and problem.mods.block_sparse:
        reasons.append("the Blackwell kernel does not walk block masks' tile lists (the Hopper kernels do); "
                       "a mask_mod without block_mask runs on it")
    return reasons
