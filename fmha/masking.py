"""Mask semantics and K/V tile classification: one definition for the reference, the host and
the kernels.

The rules (docs/semantics.md, "Masks") are expressed as a per-row band of kept key columns
``[lo(i), hi(i))``. Every mask we support has bands whose ends never decrease with ``i``, so for a
block of query rows the union and the intersection of their bands are again bands, computed from
the first and last row alone. That is what lets a kernel skip K/V tiles that no row keeps, and
apply the element-wise mask only to tiles that some row keeps partially.

The functions take plain Python integers on the host. Kernels written in the CuTe DSL call the same
functions with dynamic ``Int32`` values and pass ``cutlass.min``/``cutlass.max`` as ``imin``/``imax``;
only ``+``, ``-``, ``*``, floor division of non-negative values, and those two are used, so host and
device agree bit for bit. The mask *kind* and whether each window side is bounded (``None`` or not)
are static: they select code paths and must be Python values, never dynamic ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

__all__ = [
    "MaskKind",
    "MaskSpec",
    "KvTileSchedule",
    "row_key_bounds",
    "kv_tile_schedule",
    "num_q_tiles",
    "later_rows_cost_more",
]


class MaskKind(enum.IntEnum):
    NONE = 0
    #: sliding window; causal is the window (None, 0)
    WINDOW = 1
    #: NSA compression branch: j <= (i + 1) // c - 1 with c = S_q // S_k
    COMPRESSED_CAUSAL = 2


@dataclass(frozen=True)
class MaskSpec:
    """What the caller asked for, normalized. Window sides are ``None`` when unbounded; a bounded
    side is a band offset from the diagonal and may be negative (``right = -5``: only keys at least
    five positions before the diagonal; FlashAttention-4's convention)."""

    kind: MaskKind = MaskKind.NONE
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    bottom_right: bool = False

    @property
    def is_causal(self) -> bool:
        return self.kind == MaskKind.WINDOW and self.window_left is None and self.window_right == 0

    def describe(self) -> str:
        if self.kind == MaskKind.NONE:
            return "none"
        if self.kind == MaskKind.COMPRESSED_CAUSAL:
            return "compressed_causal"
        align = "bottom_right" if self.bottom_right else "top_left"
        if self.is_causal:
            return f"causal({align})"
        return f"window({self.window_left},{self.window_right},{align})"

    @staticmethod
    def from_args(
        causal: bool = False,
        window_size: tuple = (None, None),
        mask_align: str = "top_left",
        compressed_causal: bool = False,
    ) -> "MaskSpec":
        """Build a spec from the public keyword arguments; raise ValueError with what to change."""
        if mask_align not in ("top_left", "bottom_right"):
            raise ValueError(
                f"mask_align must be 'top_left' or 'bottom_right', got {mask_align!r}"
            )
        try:
            left, right = (None, None) if window_size is None else window_size
        except (TypeError, ValueError):
            raise ValueError(
                f"window_size must be a pair (left, right) of ints or None, got {window_size!r}"
            ) from None
        for name, w in (("left", left), ("right", right)):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
                raise ValueError(f"window_size {name} must be an int or None, got {w!r}")
        bottom_right = mask_align == "bottom_right"
        if compressed_causal:
            if causal or left is not None or right is not None:
                raise ValueError(
                    "compressed_causal=True cannot be combined with causal=True or a window_size"
                )
            if bottom_right:
                raise ValueError(
                    "compressed_causal has no alignment; leave mask_align='top_left'"
                )
            return MaskSpec(MaskKind.COMPRESSED_CAUSAL)
        if causal:
            # causal with a window keeps the window's part at or before the diagonal
            right = 0 if right is None else min(right, 0)
        if left is None and right is None:
            # An unbounded window keeps everything: alignment does not matter.
            return MaskSpec(MaskKind.NONE)
        return MaskSpec(MaskKind.WINDOW, left, right, bottom_right)


def _py_min(a, b):
    return a if a <= b else b


def _py_max(a, b):
    return a if a >= b else b


def _compression_ratio(seqlen_q: Any, seqlen_k: Any, imax: Callable):
    """Compressed causal's queries per key, c = S_q // S_k; the guards keep the device free of
    division by zero for empty sequences (validation rejects S_k == 0 or S_k > S_q where they
    could matter)."""
    return imax(seqlen_q // imax(seqlen_k, 1), 1)


def _diagonal_offset(seqlen_q: Any, seqlen_k: Any, bottom_right: bool):
    """The key of row 0's diagonal: S_k - S_q when aligned bottom-right, else 0."""
    return seqlen_k - seqlen_q if bottom_right else 0


def row_key_bounds(
    row: Any,
    seqlen_q: Any,
    seqlen_k: Any,
    kind: MaskKind,
    window_left: Any = None,
    window_right: Any = None,
    bottom_right: bool = False,
    imin: Callable = _py_min,
    imax: Callable = _py_max,
):
    """Kept key columns of query row ``row`` (0-based in its sequence): ``[lo, hi)``.

    ``lo >= hi`` means the row keeps nothing (its output is 0 and its LSE -inf).
    """
    if kind == MaskKind.NONE:
        return 0 * row, 0 * row + seqlen_k
    if kind == MaskKind.COMPRESSED_CAUSAL:
        c = _compression_ratio(seqlen_q, seqlen_k, imax)
        return 0 * row, imin((row + 1) // c, seqlen_k)
    diag = row + _diagonal_offset(seqlen_q, seqlen_k, bottom_right)
    lo = 0 * row if window_left is None else imax(diag - window_left, 0)
    hi = 0 * row + seqlen_k if window_right is None else imin(diag + window_right + 1, seqlen_k)
    return lo, hi


def first_row_past(
    key: Any,
    seqlen_q: Any,
    seqlen_k: Any,
    kind: MaskKind,
    window_left: Any = None,
    window_right: Any = None,
    bottom_right: bool = False,
    use_lo: bool = False,
    imin: Callable = _py_min,
    imax: Callable = _py_max,
):
    """The first query row whose band end (``use_lo``: start) from ``row_key_bounds`` is past key
    ``key`` (``0 <= key < seqlen_k``); ``seqlen_q`` when no row's is. Bands never move left as the
    row grows, so the rows past ``key`` are a suffix: this is that suffix's start in closed form,
    what a binary search over ``row_key_bounds`` finds."""
    if use_lo:  # lo > key
        if kind != MaskKind.WINDOW or window_left is None:  # lo = 0
            return 0 * key + seqlen_q
        offset = _diagonal_offset(seqlen_q, seqlen_k, bottom_right)
        # max(row + offset - window_left, 0) > key >= 0
        return imin(imax(key + window_left - offset + 1, 0), seqlen_q)
    if kind == MaskKind.COMPRESSED_CAUSAL:
        # min((row + 1) // c, seqlen_k) > key, with key < seqlen_k
        c = _compression_ratio(seqlen_q, seqlen_k, imax)
        return imin(c * (key + 1) - 1, seqlen_q)
    if kind != MaskKind.WINDOW or window_right is None:  # hi = seqlen_k > key
        return 0 * key
    offset = _diagonal_offset(seqlen_q, seqlen_k, bottom_right)
    # min(row + offset + window_right + 1, seqlen_k) > key, with key < seqlen_k
    return imin(imax(key - offset - window_right, 0), seqlen_q)


class KvTileSchedule(NamedTuple):
    """K/V tiles one block of query rows visits, in order: ``start`` is the first tile index,
    then ``leading_masked`` tiles that need the element-wise mask, ``unmasked`` tiles that every
    row keeps whole, and ``trailing_masked`` tiles that need the mask again. Tiles outside
    ``[start, start + total)`` are kept by no row and are skipped."""

    start: Any
    leading_masked: Any
    unmasked: Any
    trailing_masked: Any

    @property
    def total(self):
        return self.leading_masked + self.unmasked + self.trailing_masked


def kv_tile_schedule(
    m_block: Any,
    tile_m: int,
    tile_n: int,
    seqlen_q: Any,
    seqlen_k: Any,
    kind: MaskKind,
    window_left: Any = None,
    window_right: Any = None,
    bottom_right: bool = False,
    imin: Callable = _py_min,
    imax: Callable = _py_max,
    rows_per_query: int = 1,
) -> KvTileSchedule:
    """Classify the K/V tiles (of ``tile_n`` keys) for query rows
    ``[m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q))``; requires ``m_block * tile_m <
    seqlen_q``. Rows past ``seqlen_q`` in a ragged last block are ignored: nobody reads them.
    ``rows_per_query`` > 1: the rows are query heads packed with their positions (row r is query
    position r // rows_per_query, ``seqlen_q`` counts rows), as decode packs a GQA group."""
    first = m_block * tile_m
    last = imin(first + tile_m, seqlen_q) - 1
    positions = seqlen_q
    if rows_per_query > 1:
        first, last, positions = first // rows_per_query, last // rows_per_query, seqlen_q // rows_per_query

    def bounds(r):
        return row_key_bounds(
            r, positions, seqlen_k, kind, window_left, window_right, bottom_right, imin, imax
        )

    first_lo, first_hi = bounds(first)
    last_lo, last_hi = bounds(last)
    # Bands never move left as the row grows: union = [first_lo, last_hi),
    # intersection = [last_lo, first_hi).
    union_lo, union_hi = first_lo, imax(last_hi, 0)
    start = union_lo // tile_n
    end = (union_hi + tile_n - 1) // tile_n
    # Each visited tile holds at least one kept column, so there are at most (union_hi - union_lo)
    # of them; this also makes an empty union visit nothing.
    total = imin(imax(end - start, 0), imax(union_hi - union_lo, 0))
    end = start + total
    full_start = (last_lo + tile_n - 1) // tile_n
    full_end = imax(first_hi, 0) // tile_n
    full_start = imin(imax(full_start, start), end)
    full_end = imax(imin(full_end, end), full_start)
    return KvTileSchedule(start, full_start - start, full_end - full_start, end - full_end)


def split_share(schedule: KvTileSchedule, split: Any, num_splits: Any, imin: Callable = _py_min,
                imax: Callable = _py_max) -> KvTileSchedule:
    """The part of ``schedule`` that split ``split`` of ``num_splits`` visits when the tiles are
    shared out in equal consecutive runs (split-KV: each split's partial result is merged by LSE
    afterwards). A split past the tiles visits nothing."""
    per = (schedule.total + num_splits - 1) // num_splits
    end = schedule.start + schedule.total
    lo = imin(schedule.start + split * per, end)
    hi = imin(lo + per, end)
    full_lo = schedule.start + schedule.leading_masked
    full_hi = full_lo + schedule.unmasked
    a = imin(imax(full_lo, lo), hi)
    b = imin(imax(full_hi, a), hi)
    return KvTileSchedule(lo, a - lo, b - a, hi - b)


def later_rows_cost_more(kind: MaskKind, window_left_bounded: bool) -> bool:
    """Whether the keys kept per row grow with the row (causal-like masks): later query tiles
    are then costlier, which schedulers use to start the longest work first."""
    return kind == MaskKind.COMPRESSED_CAUSAL or (kind == MaskKind.WINDOW and not window_left_bounded)


def num_q_tiles(seqlen_q: Any, tile_m: int):
    return (seqlen_q + tile_m - 1) // tile_m
