"""Which K/V tiles a CTA of the Blackwell kernel visits, and which of them need the element-wise
mask: plain arithmetic shared by the device roles and the host tests.

A CTA owns ``cfg.cta_rows`` query rows (two 128-row Q tiles, one per softmax warpgroup). Every
role of the CTA walks the same K/V tiles for both Q tiles (the MMA warp interleaves their GEMMs
on each K/V stage), so the walk is ``fmha.masking.kv_tile_schedule`` over all the CTA's rows: a
tile kept by any row is visited, and a tile is left unmasked only when every row keeps it whole.

The pipelines of the kernel expect at least one K/V tile per CTA. A CTA whose rows keep no key at
all (a window that misses every key, the first rows of a compressed-causal mask, a sequence with
no keys) visits one fully masked tile: its scores are all -inf, so O = 0 and LSE = -inf come out
of the ordinary path (docs/semantics.md). That tile lies past the last key (past the first row
for a sequence with no keys, whose descriptor keeps one row): TMA zero-fills it without reading
memory, so no other sequence's values (a NaN in V would survive P = 0) and no address past the
tensor are touched.
"""

from typing import Any, Callable, NamedTuple

from fmha.masking import MaskKind, kv_tile_schedule


class KvWalk(NamedTuple):
    """Tiles ``start .. start + count - 1``; step ``i`` of the walk (0-based) is masked unless
    ``unmasked_from <= i < unmasked_to``."""

    start: Any
    count: Any
    unmasked_from: Any
    unmasked_to: Any


def cta_kv_walk(m_block: Any, cta_rows: int, tile_n: int, seqlen_q: Any, seqlen_k: Any, kind: MaskKind,
                window_left: Any = None, window_right: Any = None, bottom_right: bool = False,
                imin: Callable = min, imax: Callable = max) -> KvWalk:
    """The walk of CTA row block ``m_block`` (requires ``m_block * cta_rows < seqlen_q``)."""
    tiles = kv_tile_schedule(m_block, cta_rows, tile_n, seqlen_q, seqlen_k, kind, window_left, window_right,
                             bottom_right, imin=imin, imax=imax)
    # With no tile kept, count is 1 and unmasked_from == unmasked_to == 0: the one step is masked,
    # on the first tile past the keys. Arithmetic instead of a branch: it runs on device integers.
    kept = imin(tiles.total, 1)
    past_the_keys = imax((seqlen_k + tile_n - 1) // tile_n, 1)
    start = kept * tiles.start + (1 - kept) * past_the_keys
    return KvWalk(start, imax(tiles.total, 1), tiles.leading_masked, tiles.leading_masked + tiles.unmasked)


def step_is_masked(walk: KvWalk, step: Any):
    """Whether step ``step`` of ``walk`` needs the element-wise mask (a boolean expression that
    works on Python ints and on DSL integers alike)."""
    return (step < walk.unmasked_from) | (step >= walk.unmasked_to)
