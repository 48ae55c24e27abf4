"""What selects a compiled Hopper backward kernel (``bwd.py``), and the rules that pick it for a
problem: the backward's counterpart of ``config.py``. Why each rule is what it is, with the
measurements: docs/performance.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from fmha.masking import MaskKind, tile_costs_vary
from fmha.problem import AttentionProblem, KernelOptions

from .config import MAX_HEAD_DIM


#: query rows (the longest sequence's) from which the backward steps over 80 rows at D=128
#: without a mask (``HopperBackwardConfig.tile_m``)
LONG_ROWS = 4096

#: the backward kernel's head dims (V's equal to Q's): multiples of this up to 256, so that each
#: consumer warpgroup's half of the head dim is whole MMA columns of 16 (above 128 with its own
#: split of the work: ``split_head_dim``)
BACKWARD_HEAD_DIM_STEP = 32


def backward_head_dim_served(head_dim: int) -> bool:
    return head_dim % BACKWARD_HEAD_DIM_STEP == 0 and BACKWARD_HEAD_DIM_STEP <= head_dim <= MAX_HEAD_DIM


@dataclass(frozen=True)
class HopperBackwardConfig:
    """Everything that selects a different compiled Hopper backward kernel (``bwd.py``)."""

    dtype: torch.dtype
    head_dim: int
    mask_kind: MaskKind
    window_left_bounded: bool
    window_right_bounded: bool
    bottom_right: bool
    varlen: bool = False
    #: dQ added in K/V tile order (bitwise-repeatable), each add waiting for the one before (NSA
    #: selection: also a split list's dK and dV, in share order)
    deterministic: bool = False
    #: varlen: one CTA per listed (sequence, K/V tile), costliest first, instead of a grid over
    #: the longest sequence's K/V tiles (not with ``deterministic``, whose waits need the grid order)
    tiles_listed: bool = False
    #: the list is built on the GPU (the lengths were not read on the host)
    tiles_on_device: bool = False
    #: the longest query sequence has at least ``LONG_ROWS`` rows (set only where it selects the
    #: tile: D=128 without a mask)
    long_rows: bool = False
    #: scores capped at softcap * tanh(s / softcap) (sinks need nothing of the kernel: P comes
    #: from the LSE, which holds them, and their gradient from delta, ``HopperBackwardRunner``)
    softcap: bool = False
    #: V's head dim (and dO's, O's, dV's); None: Q's
    head_dim_v: int = None
    #: compressed causal's (block, stride); None: derived per sequence (``MaskSpec.compression``)
    compression: Optional[Tuple[int, int]] = None
    #: score_mod / mask_mod / block mask (``fmha.mods.ModsSignature``)
    mods: Optional[object] = None
    #: dense grids: the K/V heads and sequences vary fastest and the K/V tile slowest, so that under
    #: causal masks every head's costliest tiles start first (``costliest_first_pays``)
    kv_tiles_costliest_first: bool = False
    #: NSA selection (``selection_backward_config``): the keys of one consumer warpgroup (64), for
    #: which each visit (``bwd.SelectedQueryVisits``) names the query positions that chose the
    #: block holding them, each keeping those keys up to itself; 0: none
    select_block: int = 0
    #: query rows per query position (selection packs a position's GQA group as its rows)
    rows_per_query: int = 1
    #: query rows per step, where a rule other than ``tile_m``'s default chose them (0: the default)
    query_tile_rows: int = 0
    #: NSA selection: the most CTAs that walk one K/V tile's list, each a share of its query tiles
    #: (``fmha.nsa.selection_visits.list_pieces``), adding dK and dV in fp32 where it is split
    list_pieces: int = 1

    def __post_init__(self):
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.select_block and (self.select_block != self.tile_n // 2 or not self.tiles_on_device
                                  or self.mask_kind != MaskKind.NONE or self.mods is not None or self.softcap
                                  or self.split_head_dim or self.long_rows
                                  or self.tile_m % self.rows_per_query
                                  or not 1 <= self.tile_m // self.rows_per_query <= 32
                                  or not 1 <= self.list_pieces <= 64):
            raise ValueError("selection's backward walks listed K/V tiles of a varlen batch (tiles on the device) "
                             "whose warpgroups each hold one block's 64 keys, without other masks or softcap, "
                             "with at most 32 query positions per query tile")
        if self.list_pieces != 1 and not self.select_block:
            raise ValueError("only NSA selection's backward splits a K/V tile's list over several CTAs")

    @property
    def tile_n(self) -> int:
        """Keys per CTA: 64 per consumer warpgroup; at D=256 64 shared by both
        (``split_head_dim``)."""
        return 64 if self.split_head_dim else 128

    @property
    def tiles_listed_by_launch(self) -> bool:
        """The launch lists the K/V tiles on the GPU, costliest first (``device_tile_list``). A
        deterministic selection backward takes its runner's list in sequence order instead
        (``selection_visits.selection_backward_order``): its adds wait for CTAs of lower index."""
        return self.tiles_on_device and not (self.select_block and self.deterministic)

    @property
    def split_head_dim(self) -> bool:
        """D + D_v > 256 (FA4's shape at D=256): dK and dV of 64 keys per warpgroup would take
        (D + D_v) / 2 registers per thread, so both warpgroups hold all 64 keys of the CTA, each
        over its half of the head dims (half of that for both). S^T and dP^T are split by query
        columns instead, and P^T and dS^T go through shared memory, where both warpgroups'
        products read them."""
        return self.head_dim + self.head_dim_v > 256

    @property
    def q_stages(self) -> int:
        """Stages of the Q/dO ring: two, but one at D=256 (two stages of 64 x 256 Q and dO would
        leave no room for dQ's staging)."""
        return 1 if self.split_head_dim else 2

    @property
    def tile_m(self) -> int:
        """Query rows per step of the K/V tile's loop: 128 at D=64 (FA3's and FA4's; each load of
        Q, dO, LSE and delta serves twice the work, and dK/dV of D=64 leave the registers for it);
        at D=128 without a mask 80 from ``LONG_ROWS`` query rows (FA3's and FA4's tile there, with
        dQ computed transposed: fewer steps over the K/V tile at about the cost of 64 rows' step;
        below that length, and with a causal mask, 64 measured ahead); 64 elsewhere (beside
        D=128's dK and dV, 128-row S and dP tiles would not fit in registers; D=32 is not
        measured)."""
        if self.query_tile_rows:
            return self.query_tile_rows
        if self.head_dim == self.head_dim_v == 64:
            return 128
        return 80 if self.long_rows and self.head_dim_v == 128 else 64

    @property
    def dq_split_rows(self) -> bool:
        """With 128 query rows per step each consumer warpgroup computes dQ for its 64 rows over
        the whole head dim (m64 x d, reading half of dS) rather than all rows over half of it."""
        return self.tile_m == 128

    @property
    def dkv_store_tma(self) -> bool:
        """dK and dV staged in the K and V buffers with stmatrix and written by TMA stores (whole
        lines) rather than by every thread's pairs straight to global memory (varlen: through two
        more per-sequence descriptors, which stop at the sequence's end): at D=128, where each
        thread held 64 pairs; at D=64 it measured no clear gain (docs/performance.md)."""
        return self.head_dim == self.head_dim_v == 128

    #: dK is staged in K's buffer while dV's TMA store still reads V's (each buffer is staged
    #: once); a lab variant waits for dV's store first, as before
    dk_staged_under_dv_store = True
    #: the ragged-tile branch after the exponentials keeps ptxas from hoisting the wait for dP^T
    #: above them (the exponentials overlap the dP product, back to back on the MUFU pipe); a lab
    #: variant drops it at D=128 (ragged rows by an LSE of +inf): the wait goes first and the
    #: exponentials interleave with dS's arithmetic and P's conversion, as in FA4's SASS
    exps_before_dp_wait = True

    #: dS^T goes to shared memory before dV's product is issued, so that the fence after them has
    #: less to wait for (as FA4 orders them); a lab variant stores it after, as before
    ds_stored_before_dv = True

    @property
    def sequence_descriptors(self) -> int:
        """Varlen: TMA descriptors per sequence (q, k, v, dO; dK, dV). The dQ accumulator needs
        none: each sequence's query tiles have tiles of their own (``dq_layout.py``)."""
        return 6 if self.dkv_store_tma else 4

    @property
    def dq_transposed(self) -> bool:
        """A query tile that 64-row MMAs do not split (FA3's and FA4's 80 rows at D=128): dQ^T = K^T
        dS^T, each warpgroup its half of the head dim as M over all the tile's rows."""
        return self.tile_m % 64 != 0

    @property
    def dq_rows_per_warpgroup(self) -> int:
        """Query rows of one warpgroup's dQ product (all rows when it is split by head dim)."""
        return self.tile_m // 2 if self.dq_split_rows else self.tile_m

    @property
    def dq_cols_per_warpgroup(self) -> int:
        """Head-dim columns of one warpgroup's dQ product."""
        return self.head_dim if self.dq_split_rows else self.head_dim // 2

    @property
    def ds_prescaled(self) -> bool:
        """dS carries the score scale (delta comes pre-scaled), so dQ and dK need no rescale: bf16
        only. fp16 rounds dS unscaled, as its small values would otherwise sink below fp16's
        normal range (6e-5) at long rows; dQ and dK are scaled in fp32 instead."""
        return self.dtype == torch.bfloat16

    @staticmethod
    def from_problem(problem: AttentionProblem, options: KernelOptions = KernelOptions()) -> "HopperBackwardConfig":
        m = problem.mask
        listed = problem.varlen and not options.deterministic
        long_rows = problem.head_dim == 128 and m.kind == MaskKind.NONE and problem.seqlen_q >= LONG_ROWS
        cfg = HopperBackwardConfig(problem.dtype, problem.head_dim, m.kind, m.window_left is not None,
                                   m.window_right is not None, m.bottom_right if m.kind == MaskKind.WINDOW else False,
                                   problem.varlen, options.deterministic, listed,
                                   listed and problem.seqlens_q is None, long_rows, problem.softcap > 0,
                                   problem.head_dim_v, m.compression, problem.mods)
        if costliest_first_pays(cfg, problem):
            cfg = dataclasses.replace(cfg, kv_tiles_costliest_first=True)
        return cfg


#: CTAs that may share one K/V tile's list in the selection backward (``list_pieces``)
SELECTION_LIST_PIECES = 8


def selection_query_rows(head_dim: int, group: int) -> int:
    """The selection backward's query tile: at D=128 as few rows as hold one position's group, 16
    at least (dQ^T's product takes any multiple of 8 there); most positions of a wider tile did not
    choose the K/V tile's blocks, and a tile costs about its rows (docs/nsa.md). 0 elsewhere (the
    backward's own tile: dQ's products need 64 rows or D=128; groups of 1 stay refused, as the
    forward refuses them)."""
    if head_dim == 128 and 2 <= group <= 64 and group & (group - 1) == 0:
        return max(16, group)
    return 0


def selection_backward_config(dtype: torch.dtype, head_dim: int, head_dim_v: int, group: int,
                              query_tile_rows: Optional[int] = None,
                              list_pieces: Optional[int] = None, deterministic: bool = False) -> HopperBackwardConfig:
    """The backward kernel's configuration for NSA's selection branch (``fmha.nsa``): each
    sequence's tokens as a varlen sequence of (position, head of the group) rows over its keys,
    each K/V tile walking the query tiles listed for it (``SelectedQueryVisits``). By default
    long lists split over up to ``SELECTION_LIST_PIECES`` CTAs, and at D=128 16-row query tiles
    (``selection_query_rows``; elsewhere the backward's own tile). ``query_tile_rows`` (0: the
    backward's tile) and ``list_pieces`` override them (``lab/bench_selection_rows.py``).
    ``deterministic``: dQ, and a split list's dK and dV, added in a fixed order (``bwd.py``)."""
    if query_tile_rows is None:
        query_tile_rows = selection_query_rows(head_dim, group)
    if list_pieces is None:
        list_pieces = SELECTION_LIST_PIECES
    return HopperBackwardConfig(dtype, head_dim, MaskKind.NONE, False, False, False, varlen=True, tiles_listed=True,
                                tiles_on_device=True, head_dim_v=head_dim_v, select_block=64, rows_per_query=group,
                                deterministic=deterministic,
                                query_tile_rows=query_tile_rows, list_pieces=list_pieces)


def selection_backward_tile_positions(dtype: torch.dtype, head_dim: int, head_dim_v: int, group: int) -> int:
    """Query positions per query tile of the selection backward (0: the group is not served: it
    does not divide the tile's rows or leaves more positions than a 32-bit visit holds)."""
    tile_m = HopperBackwardConfig(dtype, head_dim, MaskKind.NONE, False, False, False, head_dim_v=head_dim_v,
                                  query_tile_rows=selection_query_rows(head_dim, group)).tile_m
    return tile_m // group if group >= 1 and tile_m % group == 0 and tile_m // group <= 32 else 0


#: SMs of an H100/H200 (SXM): the backward's grid-order rule counts waves of them
HOPPER_SMS = 132
#: at most this many waves of CTAs, a dense causal backward launches its costliest K/V tiles first
COSTLIEST_FIRST_MAX_WAVES = 4


def costliest_first_pays(cfg: HopperBackwardConfig, problem: AttentionProblem) -> bool:
    """Whether a dense backward should launch every head's costliest K/V tiles first. Under a
    causal mask K/V tile n walks the query tiles from n on, so its cost falls along the tile index;
    in the grid's own order (tile fastest) the GPU starts the cheap tiles of the first heads
    before the costly tiles of the last. With many waves that evens out, and the tile-fastest
    order keeps a head's CTAs together in L2 (docs/performance.md); with a few waves of long CTAs
    (GQA: one CTA walks the whole group's heads) the last costly tiles start late and run alone."""
    if (cfg.varlen or cfg.deterministic or (cfg.mods is not None and cfg.mods.block_sparse)
            or not tile_costs_vary(cfg.mask_kind, cfg.window_left_bounded)):
        return False
    ctas = problem.batch * problem.num_heads_k * -(-problem.seqlen_k // cfg.tile_n)
    return ctas <= COSTLIEST_FIRST_MAX_WAVES * HOPPER_SMS


def why_unsupported_backward(problem: AttentionProblem, options: KernelOptions) -> list:
    """Every reason the Hopper backward kernel cannot compute ``problem``'s gradients."""
    reasons = []
    if problem.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"the Hopper backward takes float16/bfloat16 inputs, not {problem.dtype}")
    if not (backward_head_dim_served(problem.head_dim) and backward_head_dim_served(problem.head_dim_v)):
        reasons.append(f"the Hopper backward takes head dims (of q/k and of v) that are multiples of "
                       f"{BACKWARD_HEAD_DIM_STEP} up to {MAX_HEAD_DIM}, got {problem.head_dim} and {problem.head_dim_v}")
    if problem.out_dtype != problem.dtype:
        reasons.append(f"the Hopper backward needs out (and dout) in q's dtype {problem.dtype}, "
                       f"not {problem.out_dtype}")
    if not (problem.score_scale > 0 and problem.score_scale < float("inf")):
        reasons.append("the Hopper backward needs softmax_scale * scale_q * scale_k to be a positive finite "
                       f"number, got {problem.score_scale}")
    if problem.mods is not None and problem.mods.block_sparse and options.deterministic:
        reasons.append("the Hopper backward's deterministic dQ order walks every query tile of a K/V tile; with a "
                       "block mask, call with deterministic=False")
    return reasons
