"""Static tile scheduling over (query tile, head, batch), shared by the kernels.

The grid is one-dimensional. With one CTA per tile the grid has one CTA per work tile and each
CTA's loop runs once; in persistent mode the grid is the SM count and CTA ``b`` takes tiles
``b, b + grid, b + 2 * grid, ...``. Both modes run the same loop, so there is one code path.

Order: the query tile index varies fastest so that CTAs running at the same time share one
head's K/V in L2. When the mask makes later query tiles costlier (causal-like masks), the tiles
are walked from the last query tile down, so the longest work starts first. A persistent grid
over such tiles instead walks the list sorted by cost (query tile index slowest: every head's
last query tile, then the ones before) and deals it out like a snake draft, CTA 0 to G-1 in one
round and G-1 back to 0 in the next, so each CTA's total lands close to the mean; a plain
grid-stride deal would give CTA 0 the costliest tile of every round. The same cost-sorted walk
in sections of heads (``cost_sorted_tile``) also serves one CTA per tile: the hardware then
hands the tiles to SMs costliest first, a few heads' K/V at a time.

``ClaimingTileScheduler`` walks the one-CTA-per-tile order with a persistent grid: a CTA that
finishes a tile claims the next unclaimed one from a counter in global memory, as the hardware
hands out CTAs, so the balance is the same; but the CTA stays resident, so the next tile's Q and
first K/V tiles load while the current one still computes instead of after it has exited.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def snake_next(idx, grid):
    """The tile after ``idx`` for its CTA in a snake deal: rounds of ``grid`` tiles, dealt to CTAs
    0 .. grid-1 and then back from grid-1 to 0 (plain arithmetic: the tests run it on ints)."""
    seat = idx % grid  # this CTA's place in the current round
    return idx - seat + grid + (grid - 1 - seat)


def cost_sorted_tile(idx, num_m_blocks, heads_batches, section, imin=min):
    """(m_block, head-batch index) of tile ``idx`` in the cost-sorted walk: heads-batches grouped
    in sections of ``section`` (the last may be shorter), each section walked query tile
    slowest, from the last query tile (the costliest under a causal-like mask) down. One section
    of all heads-batches is the plain cost order; smaller sections keep the K/V of the tiles in
    flight within L2. Plain arithmetic: the tests run it on ints."""
    per_section = section * num_m_blocks
    first = (idx // per_section) * section
    size = imin(section, heads_batches - first)
    r = idx - (idx // per_section) * per_section
    return num_m_blocks - 1 - r // size, first + r % size


def m_fastest_tile(idx, num_m_blocks, num_heads, longest_first: bool):
    """(m_block, head, batch) of tile ``idx`` when the query tile index varies fastest (from the
    last query tile down with ``longest_first``). Plain arithmetic: the tests run it on ints."""
    m = idx % num_m_blocks
    rest = idx // num_m_blocks
    if longest_first:
        m = num_m_blocks - 1 - m
    return m, rest % num_heads, rest // num_heads


class _GridStride:
    """The walk both schedulers share: CTA ``b`` starts at tile ``b``; then either ``b + grid,
    b + 2 * grid, ...`` or, when ``snake`` (tiles sorted costliest first), the snake deal of
    ``snake_next``. With one CTA per tile both walks end after the first tile."""

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def next(self, idx: Int32) -> Int32:
        grid = Int32(cute.arch.grid_dim()[0])
        if cutlass.const_expr(self.snake):
            return snake_next(idx, grid)
        return idx + grid


# Frozen: the DSL then treats it as read-only inside dynamic loops instead of loop-carried state.
@dataclass(frozen=True)
class StaticTileScheduler(_GridStride):
    num_m_blocks: Int32
    num_heads: Int32
    num_tiles: Int32
    longest_first: bool
    m_slowest: bool  # walk the tiles sorted by cost, dealt out as a snake
    section: Int32  # heads-batches per section of that walk (``cost_sorted_tile``)

    @property
    def snake(self) -> bool:
        return self.m_slowest

    @staticmethod
    def create(num_m_blocks, num_heads, num_batches, longest_first: bool,
               persistent: bool = False, section=None) -> "StaticTileScheduler":
        heads_batches = num_heads * num_batches
        return StaticTileScheduler(
            num_m_blocks, num_heads, num_m_blocks * heads_batches, longest_first,
            longest_first and (persistent or section is not None),
            heads_batches if section is None else section)

    @staticmethod
    def grid(num_tiles, num_ctas):
        """Host side: CTAs to launch for ``num_tiles`` with at most ``num_ctas`` (None: one per tile)."""
        return num_tiles if num_ctas is None else max(1, min(num_tiles, num_ctas))

    def decode(self, idx: Int32):
        """-> (m_block, head, batch)"""
        if cutlass.const_expr(self.m_slowest):
            m, rest = cost_sorted_tile(idx, self.num_m_blocks, self.num_tiles // self.num_m_blocks,
                                       self.section, imin=cutlass.min)
            return m, rest % self.num_heads, rest // self.num_heads
        return m_fastest_tile(idx, self.num_m_blocks, self.num_heads, self.longest_first)


@dataclass(frozen=True)
class ClaimingTileScheduler:
    """Persistent CTAs over the one-CTA-per-tile order (``m_fastest_tile``): CTA ``b`` starts at
    tile ``b``; afterwards its producer warp claims the next tile with an atomic add on
    ``counter`` (zeroed before the launch; claim ``c`` is tile ``grid + c``) and hands it to the
    consumers through shared memory (the end of the producer's and the consumers' tile loops in
    ``fmha/kernels/hopper/fwd.py``). A CTA's last claim is past the end, so a launch adds exactly
    ``num_tiles`` to the counter."""

    num_m_blocks: Int32
    num_heads: Int32
    num_tiles: Int32
    longest_first: bool
    counter: cute.Tensor  # (1,) int32 in global memory

    @staticmethod
    def create(num_m_blocks, num_heads, num_batches, longest_first: bool, counter) -> "ClaimingTileScheduler":
        return ClaimingTileScheduler(num_m_blocks, num_heads, num_m_blocks * num_heads * num_batches,
                                     longest_first, counter)

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    @cute.jit
    def claim(self) -> Int32:
        """The next tile for this CTA; called by every lane of one warp, one of which claims."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(self.counter.iterator, Int32(1))
        claimed = cute.arch.shuffle_sync(claimed, 0)
        return claimed + Int32(cute.arch.grid_dim()[0])

    def decode(self, idx: Int32):
        """-> (m_block, head, batch)"""
        return m_fastest_tile(idx, self.num_m_blocks, self.num_heads, self.longest_first)


@dataclass(frozen=True)
class TileTableScheduler(_GridStride):
    """Varlen: walks the host's list of (batch, m_block) work tiles (``fmha.work_tiles``, costliest
    first) with the heads varying fastest, so CTAs running together share a sequence's K/V
    (in L2) and only query tiles that hold rows are launched. Same interface and grid
    conventions as ``StaticTileScheduler``."""

    table: cute.Tensor  # (N, 2) int32: batch, m_block
    num_heads: Int32
    num_tiles: Int32
    snake = True  # the table is sorted costliest first

    @staticmethod
    def create(table: cute.Tensor, num_heads) -> "TileTableScheduler":
        return TileTableScheduler(table, num_heads, table.shape[0] * num_heads)

    def decode(self, idx: Int32):
        """-> (m_block, head, batch)"""
        entry = idx // self.num_heads
        return self.table[entry, 1], idx % self.num_heads, self.table[entry, 0]
