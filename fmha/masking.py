"""Mask semantics: one definition for the reference, the host and the kernels.

The rules (docs/semantics.md, "Masks") are expressed as a per-row band of kept key columns
``[lo(i), hi(i))``. Every mask we support has bands whose ends never decrease with ``i``, so for a
block of query rows the union and the intersection of their bands are again bands, computed from
the first and last row alone. That is what lets a kernel skip K/V tiles that no row keeps, and
apply the element-wise mask only to tiles that some row keeps partially (the K/V walk,
``fmha.kernels.common.kv_walk``).

The functions take plain Python integers on the host. Kernels written in the CuTe DSL call the same
functions with dynamic ``Int32`` values and pass ``cutlass.min``/``cutlass.max`` as ``imin``/``imax``;
only ``+``, ``-``, ``*``, floor division of non-negative values, and those two are used, so host and
device agree bit for bit. The mask *kind*, compressed causal's geometry and whether each window
side is bounded (``None`` or not) are static: they select code paths and must be Python values, never dynamic ones.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

__all__ = [
    "MaskKind",
    "MaskSpec",
    "row_key_bounds",
    "first_row_past",
    "num_q_tiles",
    "tile_costs_vary",
]


class MaskKind(enum.IntEnum):
    NONE = 0
    #: sliding window; causal is the window (None, 0)
    WINDOW = 1
    #: NSA compression branch: key j (a summary of ``block`` tokens every ``stride``) is kept by
    #: row i when j * stride + block - 1 <= i; without a geometry block = stride = S_q // S_k
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
    #: compressed causal's (block, stride); None: block = stride = S_q // S_k of each sequence
    compression: Optional[Tuple[int, int]] = None

    @property
    def is_causal(self) -> bool:
        return self.kind == MaskKind.WINDOW and self.window_left is None and self.window_right == 0

    def describe(self) -> str:
        if self.kind == MaskKind.NONE:
            return "none"
        if self.kind == MaskKind.COMPRESSED_CAUSAL:
            if self.compression is None:
                return "compressed_causal"
            return "compressed_causal(block=%d,stride=%d)" % self.compression
        align = "bottom_right" if self.bottom_right else "top_left"
        if self.is_causal:
            return f"causal({align})"
        return f"window({self.window_left},{self.window_right},{align})"

    @staticmethod
    def from_args(
        causal: bool = False,
        window_size: tuple = (None, None),
        mask_align: str = "top_left",
        compressed_causal=False,
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
        compression = _compression_geometry(compressed_causal)
        if compressed_causal is not False:
            if causal or left is not None or right is not None:
                raise ValueError(
                    "compressed_causal cannot be combined with causal=True or a window_size"
                )
            if bottom_right:
                raise ValueError(
                    "compressed_causal has no alignment; leave mask_align='top_left'"
                )
            return MaskSpec(MaskKind.COMPRESSED_CAUSAL, compression=compression)
        if causal:
            # causal with a window keeps the window's part at or before the diagonal
            right = 0 if right is None else min(right, 0)
        if left is None and right is None:
            # An unbounded window keeps everything: alignment does not matter.
            return MaskSpec(MaskKind.NONE)
        return MaskSpec(MaskKind.WINDOW, left, right, bottom_right)


def _compression_geometry(compressed_causal) -> Optional[Tuple[int, int]]:
    """``compressed_causal``: False, True (block = stride = S_q // S_k) or ``(block, stride)``."""
    if isinstance(compressed_causal, bool):
        return None
    try:
        block, stride = compressed_causal
    except (TypeError, ValueError):
        raise ValueError(
            "compressed_causal must be False, True or a pair (block, stride) of positive ints, "
            f"got {compressed_causal!r}"
        ) from None
    for name, x in (("block", block), ("stride", stride)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"compressed_causal's {name} must be a positive int, got {x!r}")
    return (block, stride)


def _py_min(a, b):
    return a if a <= b else b


def _py_max(a, b):
    return a if a >= b else b


def _compression_ratio(seqlen_q: Any, seqlen_k: Any, imax: Callable):
    """Compressed causal's queries per key without a geometry, c = S_q // S_k; the guards keep
    the device free of division by zero for empty sequences (validation rejects S_k == 0 or
    S_k > S_q where they could matter)."""
    return imax(seqlen_q // imax(seqlen_k, 1), 1)


def _compressed_hi(row: Any, seqlen_q: Any, seqlen_k: Any, compression, imin: Callable, imax: Callable):
    """End of row ``row``'s kept compressed keys: the j with j * stride + block - 1 <= row."""
    if compression is None:
        c = _compression_ratio(seqlen_q, seqlen_k, imax)
        return imin((row + 1) // c, seqlen_k)
    block, stride = compression
    # floor((row + 1 - block) / stride) + 1, clamped at 0 before dividing (non-negative division)
    return imin(imax(row + 1 + stride - block, 0) // stride, seqlen_k)


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
    compression: Optional[Tuple[int, int]] = None,
):
    """Kept key columns of query row ``row`` (0-based in its sequence): ``[lo, hi)``.

    ``lo >= hi`` means the row keeps nothing (its output is 0 and its LSE -inf).
    """
    if kind == MaskKind.NONE:
        return 0 * row, 0 * row + seqlen_k
    if kind == MaskKind.COMPRESSED_CAUSAL:
        return 0 * row, _compressed_hi(row, seqlen_q, seqlen_k, compression, imin, imax)
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
    compression: Optional[Tuple[int, int]] = None,
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
        # key * stride + block - 1 <= row, with key < seqlen_k
        if compression is None:
            c = _compression_ratio(seqlen_q, seqlen_k, imax)
            return imin(c * (key + 1) - 1, seqlen_q)
        block, stride = compression
        return imin(key * stride + block - 1, seqlen_q)
    if kind != MaskKind.WINDOW or window_right is None:  # hi = seqlen_k > key
        return 0 * key
    offset = _diagonal_offset(seqlen_q, seqlen_k, bottom_right)
    # min(row + offset + window_right + 1, seqlen_k) > key, with key < seqlen_k
    return imin(imax(key - offset - window_right, 0), seqlen_q)


def tile_costs_vary(kind: MaskKind, window_left_bounded: bool, block_sparse: bool = False) -> bool:
    """Whether query tiles differ in cost: causal-like masks keep more keys for later rows, and a
    block mask lists each query tile's own K/V tiles. Schedulers then claim tiles and start the
    last query tiles (the longest under causal-like masks) first."""
    causal_like = kind == MaskKind.COMPRESSED_CAUSAL or (kind == MaskKind.WINDOW and not window_left_bounded)
    return causal_like or block_sparse


def num_q_tiles(seqlen_q: Any, tile_m: int):
    return (seqlen_q + tile_m - 1) // tile_m
