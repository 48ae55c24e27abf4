"""The K/V walk: which K/V tiles a block of query rows visits, in which order, and which of them
need the element-wise mask; and its transpose for the backward, the query tiles a K/V tile
visits. One object for every kernel (Hopper forward and decode, Hopper backward, Blackwell
forward) and for the host's cost estimates and tests.

The walk is plain integer arithmetic over the row bands of ``fmha.masking`` (``row_key_bounds``,
``first_row_past``): it runs on Python ints and, with ``imin``/``imax`` = ``cutlass.min``/``max``,
on the DSL's dynamic ``Int32`` values. The masks served today keep one contiguous band of keys per
row, so a walk is a run of consecutive tiles in three segments (masked, whole, masked). A kernel
reads a walk only through ``total``, ``block(step)``, the three segment counts and
``needs_mask`` (and ``first_key``/``visit`` for where a tile's keys start and what else its mask
needs), so a walk over a list of tile indices (``ListedKvWalk``: block-sparse masks) takes its
place: its ``block`` reads the list, its partial tiles then its whole ones are the leading masked
and unmasked segments. NSA's selected blocks (``SelectedKvWalk``) are such a list of key rows,
each with the query positions that chose it.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple

from fmha.masking import MaskKind, first_row_past, row_key_bounds


def _py_min(a, b):
    return a if a <= b else b


def _py_max(a, b):
    return a if a >= b else b


class _Segments:
    """The reads both walks share: three segments of steps, masked, whole, masked."""

    __slots__ = ()

    @property
    def total(self):
        return self.leading_masked + self.unmasked + self.trailing_masked

    def needs_mask(self, step):
        """Whether step ``step`` needs the element-wise mask (works on Python and DSL ints)."""
        return (step < self.leading_masked) | (step >= self.leading_masked + self.unmasked)

    def first_key(self, step, tile_n: int):
        """The first key of step ``step``'s tile."""
        return self.key_of(self.block(step), tile_n)

    def key_of(self, block, tile_n: int):
        """The first key of the tile a step's ``block`` names: blocks are whole key tiles, but
        for a walk over key rows (``SelectedKvWalk``)."""
        return block * tile_n

    def visit(self, step):
        """What the mask needs of step ``step`` besides its place: nothing, but for a walk over
        selected blocks (``SelectedKvWalk``) the query positions that chose it."""
        return None


class _BandFields(NamedTuple):
    start: Any
    leading_masked: Any
    unmasked: Any
    trailing_masked: Any


class KvWalk(_Segments, _BandFields):
    """Tiles ``start .. start + total - 1``: ``leading_masked`` tiles that need the element-wise
    mask, ``unmasked`` tiles that every row keeps whole, then ``trailing_masked`` masked ones.
    Tiles outside the walk are kept by no row and are skipped."""

    __slots__ = ()

    def block(self, step):
        """The K/V tile index of step ``step`` (0-based)."""
        return self.start + step

    def split_share(self, split: Any, num_splits: Any, imin: Callable = _py_min,
                    imax: Callable = _py_max) -> "KvWalk":
        """The part split ``split`` of ``num_splits`` visits when the tiles are shared out in equal
        consecutive runs (split-KV: the splits' partial results are merged by LSE afterwards). A
        split past the tiles visits nothing."""
        per = (self.total + num_splits - 1) // num_splits
        end = self.start + self.total
        lo = imin(self.start + split * per, end)
        hi = imin(lo + per, end)
        full_lo = self.start + self.leading_masked
        full_hi = full_lo + self.unmasked
        a = imin(imax(full_lo, lo), hi)
        b = imin(imax(full_hi, a), hi)
        return KvWalk(lo, a - lo, b - a, hi - b)

    def at_least_one_tile(self, seqlen_k: Any, tile_n: int, imin: Callable = _py_min,
                          imax: Callable = _py_max) -> "KvWalk":
        """This walk, or for an empty one a single masked tile past the last key (for pipelines
        that expect a tile: its scores are all -inf, so O = 0 and LSE = -inf come out of the
        ordinary path, and TMA zero-fills it without reading memory). Arithmetic instead of a
        branch: it runs on device integers."""
        kept = imin(self.total, 1)
        past_the_keys = imax((seqlen_k + tile_n - 1) // tile_n, 1)
        start = kept * self.start + (1 - kept) * past_the_keys
        return KvWalk(start, self.leading_masked, self.unmasked, self.trailing_masked + (1 - kept))


class _ListFields(NamedTuple):
    indices: Any
    leading_masked: Any
    unmasked: Any
    trailing_masked: Any = 0


class ListedKvWalk(_Segments, _ListFields):
    """A walk over a list of tiles (a block mask's, ``fmha.block_mask.BlockMask.tile_lists``):
    ``indices`` (a row of the list) holds ``leading_masked`` tiles that need the element-wise
    mask, then ``unmasked`` whole ones. The same reads as ``KvWalk``."""

    __slots__ = ()

    def block(self, step):
        return self.indices[step]


class _SelectedFields(NamedTuple):
    rows: Any
    positions: Any
    leading_masked: Any
    unmasked: Any
    trailing_masked: Any = 0


class SelectedKvWalk(_Segments, _SelectedFields):
    """A walk over NSA's selected blocks (``fmha.nsa.selection_visits``): step i loads the
    tile of keys from row ``rows[i]`` on (any row: a block starts where its sequence does), and
    bit j of ``positions[i]`` says that the query tile's j-th query position selected it. The
    ``leading_masked`` blocks some position did not select, or selected only partly (the block
    reaches past it), then ``unmasked`` ones that every position keeps whole."""

    __slots__ = ()

    def block(self, step):
        return self.rows[step]

    def key_of(self, block, tile_n: int):
        return block

    def visit(self, step):
        return self.positions[step]


def listed_walk(counts, indices, masked_too: bool = False) -> ListedKvWalk:
    """The walk of one list entry: ``counts`` (partial, full), ``indices`` the listed tiles;
    ``masked_too``: a built-in mask applies on top, so every listed tile is masked."""
    if masked_too:
        return ListedKvWalk(indices, counts[0] + counts[1], 0)
    return ListedKvWalk(indices, counts[0], counts[1])


def every_tile_masked(walk: KvWalk) -> KvWalk:
    """``walk`` with every tile element-wise masked."""
    return KvWalk(walk.start, walk.total, 0 * walk.unmasked, 0 * walk.unmasked)


def mask_mod_on_every_tile(mods) -> bool:
    """Whether a kernel built with mods ``mods`` (``fmha.mods.ModsSignature`` or None) masks every
    tile: a mask mod without a block mask can drop any key."""
    return mods is not None and mods.mask_mod is not None and not mods.block_sparse


def masked_for_mods(walk: KvWalk, mods) -> KvWalk:
    """The band walk of a kernel built with mods ``mods``: every tile masked where
    ``mask_mod_on_every_tile``."""
    return every_tile_masked(walk) if mask_mod_on_every_tile(mods) else walk


def kv_walk(
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
    compression: Optional[Tuple[int, int]] = None,
) -> KvWalk:
    """The walk of query rows ``[m_block * tile_m, min((m_block + 1) * tile_m, seqlen_q))`` over
    tiles of ``tile_n`` keys; requires ``m_block * tile_m < seqlen_q``. Rows past ``seqlen_q``
    in a ragged last block are ignored: nobody reads them. ``rows_per_query`` > 1: the rows are
    query heads packed with their positions (row r is query position r // rows_per_query,
    ``seqlen_q`` counts rows), as decode packs a GQA group."""
    first = m_block * tile_m
    last = imin(first + tile_m, seqlen_q) - 1
    positions = seqlen_q
    if rows_per_query > 1:
        first, last, positions = first // rows_per_query, last // rows_per_query, seqlen_q // rows_per_query

    def bounds(r):
        return row_key_bounds(r, positions, seqlen_k, kind, window_left, window_right, bottom_right, imin, imax,
                              compression)

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
    return KvWalk(start, full_start - start, full_end - full_start, end - full_end)


class QueryWalk(NamedTuple):
    """The backward's transpose of the walk: query tiles ``start .. start + count - 1`` hold a
    row that keeps a key of the K/V tile."""

    start: Any
    count: Any

    @property
    def end(self):
        return self.start + self.count


def query_walk(
    n_block: Any,
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
    compression: Optional[Tuple[int, int]] = None,
    select: Callable = lambda cond, a, b: a if cond else b,
) -> QueryWalk:
    """The query tiles K/V tile ``n_block`` (with keys: ``n_block * tile_n < seqlen_k``) visits:
    from the first row whose band end is past the tile's first key to the first row whose band
    start is past its last key (closed forms, ``fmha.masking.first_row_past``). ``select(cond,
    a, b)``: ``cutlass.select_`` on the device."""
    num_m = (seqlen_q + tile_m - 1) // tile_m
    if kind == MaskKind.NONE:
        return QueryWalk(0 * n_block, num_m)
    n0 = n_block * tile_n
    n1 = imin(n0 + tile_n, seqlen_k)

    def past(key, use_lo):
        return first_row_past(key, seqlen_q, seqlen_k, kind, window_left, window_right, bottom_right, use_lo,
                              imin, imax, compression)

    first, end = past(n0, False), past(n1 - 1, True)
    m_start = first // tile_m
    m_end = imax((end + tile_m - 1) // tile_m, m_start)
    # rows past the tile's first key start after the rows past its last key begin: no row keeps it
    m_end = select(first >= end, m_start, m_end)
    return QueryWalk(m_start, m_end - m_start)
