"""The score-and-mask object of a score fragment: softcap (every tile) and the element-wise mask
from the same row bands the host uses (``fmha.masking.row_key_bounds``; only tiles the tile
schedule marks as masked pay for it). One object serves every kernel's fragment: the Hopper
forward's warpgroup-MMA accumulator (``apply_scores``), the Hopper backward's transposed S^T
(``softcap``, ``apply_transposed``) and the Blackwell softmax's row per thread
(``apply_row_scores``).

Softcap keeps the kernels' score units: a kernel holds ``tanh(q.k * softcap_factor)`` in place of
the raw q.k and its softmax scale becomes ``softcap * log2(e)`` (``AttentionProblem.
softmax_scale_log2``), so the running max, the LSE and the backward's P recomputation need no
other change. The backward's derivative of the cap comes back from P itself (``softcap_slope``).

Programmable attention (``fmha.mods``) joins here too: ``ScoreMods`` holds a call's traced
``score_mod`` / ``mask_mod`` with the batch entry, head and tensors they read; the score mod runs
on every score (in the softmax's units: the scaled score in, divided back by the scale out), the
mask mod wherever the element-wise mask runs.

A row's kept keys are one interval ``[lo, hi)``. Instead of two compares per score, each thread
turns the interval into a 32-bit mask over its own columns of the row (``kept_column_bits``) and
tests one constant bit per score, which ptxas lowers to R2P + FSEL."""

import math
from dataclasses import dataclass
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fmha.masking import MaskKind, row_key_bounds
from fmha.mods import Dual, bind_signature, call_mask_mod, call_score_mod

from .fragments import as_rows_cols, ptx_b32

# A thread's columns of one row of a warpgroup-MMA accumulator, in ``as_rows_cols`` order: pairs
# of adjacent columns, the pairs 8 apart. Column i of the thread's row sits at offset
# ``column_offset(i)`` from the thread's first column; 32 of them (a chunk) span 128 columns.
CHUNK = 32


def column_offset(i: int) -> int:
    return 8 * (i // 2) + i % 2


def _count_below(limit, imin, imax):
    """How many of a chunk's columns have offsets below ``limit`` (any integer)."""
    h = imin(imax(limit, 0), 4 * CHUNK)
    return 2 * (h >> 3) + imin(h & 7, 2)


def kept_column_bits(lo_rel, hi_rel, chunk: int, shr=None, shl=None, imin=min, imax=max):
    """Bit i set iff the thread's column ``CHUNK * chunk + i`` is kept, for a row keeping offsets
    ``[lo_rel, hi_rel)`` relative to the thread's first column. ``shr``/``shl`` shift 0xFFFFFFFF
    by 0..32 with PTX semantics (32 gives 0); the defaults do it on Python ints."""
    shr = shr or (lambda n: (0xFFFFFFFF >> n) if n < 32 else 0)
    shl = shl or (lambda n: (0xFFFFFFFF << n) & 0xFFFFFFFF if n < 32 else 0)
    base = 4 * CHUNK * chunk
    below_hi = shr(CHUNK - _count_below(hi_rel - base, imin, imax))
    from_lo = shl(_count_below(lo_rel - base, imin, imax))
    return below_hi & from_lo


@dsl_user_op
def _ones_shifted(amount: Int32, left: bool, *, loc=None, ip=None) -> Uint32:
    """0xFFFFFFFF shifted by ``amount`` in 0..32, in PTX (whose shift by 32 gives 0; the same
    shift in LLVM IR would be poison)."""
    op = "shl" if left else "shr"
    return Uint32(ptx_b32(f"{op}.b32 $0, -1, $1;", "=r,r", [Int32(amount)], loc=loc, ip=ip))


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """One MUFU ``tanh.approx.f32`` (relative error about 2^-11, as FlashAttention's softcap)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)], "tanh.approx.f32 $0, $1;",
                                   "=f,f", has_side_effects=False, is_align_stack=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def softcap_scores(s: cute.Tensor, factor: Float32):
    """``s = tanh(s * factor)`` for every element of the (rows, cols) view ``s``."""
    for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(s, mode=[1])):
            s[r, c] = tanh_approx(s[r, c] * factor)


@cute.jit
def softcap_slope(p: Float32, lse_log2: Float32, inv_scale_log2: Float32) -> Float32:
    """The cap's derivative ``1 - t^2`` of a score whose probability is ``p = exp2(t * scale_log2 -
    lse_log2)``: t comes back as ``(log2 p + lse_log2) / scale_log2``, clamped to [-1, 1] (a p of 0,
    masked or underflowed, gives -inf or NaN there, which the clamp turns into a slope of 0)."""
    t = (cute.math.log2(p, fastmath=True) + lse_log2) * inv_scale_log2
    t = cute.arch.fmin(cute.arch.fmax(t, Float32(-1.0)), Float32(1.0))
    return Float32(1.0) - t * t


@dataclass(frozen=True)
class ScoreMods:
    """A call's score and mask mods as one kernel traces them: the functions bound to the
    kernel's views of their tensors (static), the batch entry and query head of the tile, and
    the score scale (the kernels hold raw q.k; a mod sees q.k times ``scale``)."""

    signature: Any  # fmha.mods.ModsSignature
    score_fn: Any
    mask_fn: Any
    aux: Any
    batch: Any
    head: Any
    scale: Any
    inv_scale: Any

    @staticmethod
    def of(signature, mod_tensors, batch, head, scale_log2):
        """``None`` without mods; ``scale_log2``: the softmax's scale of the held score."""
        if signature is None:
            return None
        score_fn, mask_fn, aux = bind_signature(signature, mod_tensors)
        scale = scale_log2 * Float32(1.0 / math.log2(math.e))
        return ScoreMods(signature, score_fn, mask_fn, aux, batch, head, scale, Float32(1.0) / scale)

    @property
    def has_score_mod(self) -> bool:
        return self.score_fn is not None

    @property
    def has_mask_mod(self) -> bool:
        return self.mask_fn is not None

    def score(self, held, q_idx, kv_idx):
        """The modified score of the held (unscaled) ``held``, in held units."""
        out = call_score_mod(self.signature.score_mod, self.score_fn, held * self.scale, self.batch, self.head,
                             q_idx, kv_idx, self.aux)
        return Float32(out) * self.inv_scale

    def score_and_slope(self, held, q_idx, kv_idx):
        """(modified score in held units, d modified / d score): the dual number through the mod;
        a slope that is a Python number is a constant of the mod."""
        out = call_score_mod(self.signature.score_mod, self.score_fn, Dual(held * self.scale, 1.0), self.batch,
                             self.head, q_idx, kv_idx, self.aux)
        out = Dual.of(out)
        slope = out.grad if isinstance(out.grad, (int, float)) else Float32(out.grad)
        return Float32(out.value) * self.inv_scale, slope

    def constant_slope(self):
        """The score mod's derivative if the mod makes it a constant (a Python number), else
        None: traced once on placeholder values (code the compiler drops)."""
        _, slope = self.score_and_slope(Float32(0.0), Int32(0), Int32(0))
        return float(slope) if isinstance(slope, (int, float)) else None

    def keeps(self, q_idx, kv_idx):
        return cutlass.Boolean(call_mask_mod(self.signature.mask_mod, self.mask_fn, self.batch, self.head, q_idx,
                                             kv_idx, self.aux))


@dataclass(frozen=True)
class FragmentMask:
    """Mask parameters of one (sequence, query tile); ``kind``/``bottom_right`` and the
    None-ness of each window side are static, the rest is dynamic."""

    kind: MaskKind
    seqlen_q: Any
    seqlen_k: Any
    window_left: Any = None
    window_right: Any = None
    bottom_right: bool = False
    #: rows per query position (a packed GQA group, ``kv_walk``): ``seqlen_q`` counts rows
    rows_per_query: int = 1
    #: softcap: the raw q.k's factor before tanh; None (static) for none
    softcap_factor: Any = None
    #: compressed causal's static (block, stride) (``fmha.masking.MaskSpec.compression``)
    compression: Any = None
    #: score_mod / mask_mod (``ScoreMods``), or None
    mods: Any = None
    #: the static (query rows, keys) of the kernel's tile
    tile: Any = None
    #: NSA selection (static): each visited tile is a selected block of this many keys from its
    #: first one, kept by the query positions its visit names (``selected_bounds``); 0: none
    select_block: int = 0

    @staticmethod
    def of(cfg, seqlen_q, seqlen_k, window_left, window_right, softcap_factor=None, mods=None) -> "FragmentMask":
        """The object of one (sequence, tile) of a kernel built from config ``cfg`` (its static
        mask kind, alignment, compression geometry, GQA row packing, tile and selection)."""
        return FragmentMask(cfg.mask_kind, seqlen_q, seqlen_k, window_left, window_right, cfg.bottom_right,
                            getattr(cfg, "rows_per_query", 1), softcap_factor, cfg.compression, mods,
                            (cfg.tile_m, cfg.tile_n), getattr(cfg, "select_block", 0))

    @property
    def has_mask_mod(self) -> bool:
        return self.mods is not None and self.mods.has_mask_mod

    @property
    def needs_positions(self) -> bool:
        """Whether every score needs its position (a score mod), masked or not."""
        return self.mods is not None and self.mods.has_score_mod

    def constant_slope(self):
        """The score mod's derivative where it is a constant (1.0 without a score mod), else None."""
        if self.mods is None or not self.mods.has_score_mod:
            return 1.0
        return self.mods.constant_slope()

    @cute.jit
    def score_mod_transposed(self, s: cute.Tensor, coords: cute.Tensor, row_base, col_base, slopes=None):
        """The score mod on a transposed (keys, queries) view ``s`` (the Hopper backward's S^T),
        each score's slope into ``slopes`` where given."""
        if cutlass.const_expr(self.needs_positions):
            if self.inside(row_base, col_base):
                self._score_mod_transposed(s, coords, row_base, col_base, slopes, False)
            else:
                self._score_mod_transposed(s, coords, row_base, col_base, slopes, True)

    @cute.jit
    def _score_mod_transposed(self, s, coords, row_base, col_base, slopes, clamped: cutlass.Constexpr):
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                q_idx, kv_idx = self.positions(row_base + coords[r, j][1], col_base + coords[r, j][0], clamped)
                if cutlass.const_expr(slopes is None):
                    s[r, j] = self.mods.score(s[r, j], q_idx, kv_idx)
                else:
                    s[r, j], slopes[r, j] = self.mods.score_and_slope(s[r, j], q_idx, kv_idx)

    def positions(self, row, col, clamped: bool = True):
        """A score's (q_idx, kv_idx) as a mod sees them: ``clamped`` into the sequence, so that a
        mod indexing a tensor by them never reads past it (scores outside are masked anyway)."""
        if not clamped:
            return row, col
        return cutlass.min(row, self.seqlen_q - 1), cutlass.min(col, self.seqlen_k - 1)

    def inside(self, row_base, col_base):
        """Whether the tile at (``row_base``, ``col_base``) lies within the sequence: a score mod
        then takes positions unclamped, which saves two min per score and the registers ptxas
        held them in (a mask mod's single path does not spill)."""
        return (row_base + self.tile[0] <= self.seqlen_q) & (col_base + self.tile[1] <= self.seqlen_k)

    @cute.jit
    def apply_scores(self, acc_s: cute.Tensor, coords: cute.Tensor, row_base, col_base, masked: cutlass.Constexpr,
                     visit=None):
        """A tile's scores as the softmax takes them: softcapped or score-modded (before the
        mask: tanh(-inf) would keep a masked key), then masked where ``masked``. ``visit``: the
        K/V walk's ``visit`` of the tile (selection: the positions that chose it)."""
        if cutlass.const_expr(self.softcap_factor is not None):
            softcap_scores(as_rows_cols(acc_s), self.softcap_factor)
        if cutlass.const_expr(self.needs_positions):
            if self.inside(row_base, col_base):
                self._score_mod(as_rows_cols(acc_s), as_rows_cols(coords), row_base, col_base, False)
            else:
                self._score_mod(as_rows_cols(acc_s), as_rows_cols(coords), row_base, col_base, True)
        if cutlass.const_expr(masked):
            self.apply(acc_s, coords, row_base, col_base, visit)

    @cute.jit
    def _score_mod(self, s, c, row_base, col_base, clamped: cutlass.Constexpr):
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            for i in cutlass.range_constexpr(cute.size(s, mode=[1])):
                q_idx, kv_idx = self.positions(row_base + c[r, i][0], col_base + c[r, i][1], clamped)
                s[r, i] = self.mods.score(s[r, i], q_idx, kv_idx)

    @cute.jit
    def softcap(self, s: cute.Tensor):
        """Softcap of a (rows, cols) view of scores, where the object has one."""
        if cutlass.const_expr(self.softcap_factor is not None):
            softcap_scores(s, self.softcap_factor)

    @cute.jit
    def apply_row_scores(self, s: cute.Tensor, cols: cute.Tensor, row, col_base, masked):
        """``apply_scores`` for a thread that holds scores of one row (Blackwell's softmax):
        ``cols[i][1]`` is score i's column within the tile; ``masked`` may be dynamic."""
        if cutlass.const_expr(self.softcap_factor is not None):
            for i in cutlass.range_constexpr(cute.size(s)):
                s[i] = tanh_approx(s[i] * self.softcap_factor)
        if cutlass.const_expr(self.needs_positions):
            # one clamped path: a second copy of 128 scores' code would not fit the registers
            for i in cutlass.range_constexpr(cute.size(s)):
                s[i] = self.mods.score(s[i], *self.positions(row, col_base + cols[i][1]))
        if masked:
            self._row_mask(s, cols, row, col_base)

    @cute.jit
    def _row_mask(self, s, cols, row, col_base):
        lo, hi = self.key_bounds(row)
        # relative to this tile's first column: one compare against a constant per bound
        lo_rel, hi_rel = lo - col_base, hi - col_base
        for i in cutlass.range_constexpr(cute.size(s)):
            col = cols[i][1]
            kept = (col >= lo_rel) & (col < hi_rel)
            if cutlass.const_expr(self.has_mask_mod):
                kept = kept & self.mods.keeps(*self.positions(row, col_base + col))
            s[i] = s[i] if kept else Float32(-math.inf)

    @cute.jit
    def apply_transposed(self, s: cute.Tensor, coords: cute.Tensor, row_base, col_base):
        """Set masked scores of a transposed (rows: keys, columns: queries) view ``s`` to -inf
        (the Hopper backward's S^T); ``coords`` its (key, query) coordinates within the tile,
        ``row_base``/``col_base`` the tile's first query and key."""
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            lo, hi = self.key_bounds(row_base + coords[0, j][1])
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                key = col_base + coords[r, j][0]
                if cutlass.const_expr(self.has_mask_mod):
                    q_idx, kv_idx = self.positions(row_base + coords[r, j][1], key)
                    kept = (key >= lo) & (key < hi) & self.mods.keeps(q_idx, kv_idx)
                    s[r, j] = s[r, j] if kept else Float32(-math.inf)
                elif key < lo or key >= hi:
                    s[r, j] = Float32(-math.inf)

    @cute.jit
    def apply_selected_transposed(self, s: cute.Tensor, coords: cute.Tensor, row_base, col_base, key_base,
                                  positions):
        """NSA selection on the Hopper backward's S^T (``apply_transposed``'s view): this thread's
        keys lie in the selected block's keys from ``key_base`` on, which the query positions
        whose bits ``positions`` holds chose; each keeps them up to itself (``selected_bounds``)."""
        for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
            lo, hi = self.selected_bounds(row_base, row_base + coords[0, j][1], key_base, positions)
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                key = col_base + coords[r, j][0]
                if key < lo or key >= hi:
                    s[r, j] = Float32(-math.inf)

    def selected_bounds(self, row_base, row, col_base, positions):
        """A row's kept keys ``[lo, hi)`` in a selected block from key ``col_base`` on: the keys
        of the block up to the row's query position, if bit j of ``positions`` is set for its
        position (the j-th of the tile's, which starts at row ``row_base``); none otherwise."""
        g = self.rows_per_query
        t = row // g
        chose = ((positions >> (t - row_base // g)) & 1) != 0
        return col_base, cutlass.select_(chose, cutlass.min(col_base + self.select_block, t + 1), col_base)

    def key_bounds(self, row):
        g = self.rows_per_query
        return row_key_bounds(
            row // g if g > 1 else row, self.seqlen_q // g if g > 1 else self.seqlen_q, self.seqlen_k, self.kind,
            self.window_left, self.window_right, self.bottom_right, imin=cutlass.min, imax=cutlass.max,
            compression=self.compression,
        )

    @cute.jit
    def apply(self, acc_s: cute.Tensor, coords: cute.Tensor, row_base, col_base, visit=None):
        """Set masked scores of ``acc_s`` (a warpgroup-MMA accumulator) to -inf. ``coords`` is the
        identity tensor of the tile partitioned like ``acc_s``; ``row_base``/``col_base`` place the
        tile in the sequence; ``visit``: the walk's (``apply_scores``)."""
        s = as_rows_cols(acc_s)
        c = as_rows_cols(coords)
        num_cols = cute.size(s, mode=[1])
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            if cutlass.const_expr(self.select_block):
                lo, hi = self.selected_bounds(row_base, row_base + c[r, 0][0], col_base, visit)
            else:
                lo, hi = self.key_bounds(row_base + c[r, 0][0])
            first = col_base + c[r, 0][1]
            for k in cutlass.range_constexpr((num_cols + CHUNK - 1) // CHUNK):
                keep = kept_column_bits(
                    lo - first, hi - first, k, lambda n: _ones_shifted(n, False),
                    lambda n: _ones_shifted(n, True), cutlass.min, cutlass.max)
                for i in cutlass.range_constexpr(min(CHUNK, num_cols - CHUNK * k)):
                    kept = cutlass.Boolean(keep & (cutlass.Uint32(1) << i))
                    if cutlass.const_expr(self.has_mask_mod):
                        q_idx, kv_idx = self.positions(row_base + c[r, CHUNK * k + i][0],
                                                       col_base + c[r, CHUNK * k + i][1])
                        kept = kept & self.mods.keeps(q_idx, kv_idx)
                    s[r, CHUNK * k + i] = s[r, CHUNK * k + i] if kept else Float32(-math.inf)
