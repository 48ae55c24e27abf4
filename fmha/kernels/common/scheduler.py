"""Which query tile a CTA works on next: the tile schedulers every kernel shares.

A work tile is (query tile ``m_block``, head, batch), numbered 0 .. ``num_tiles`` - 1 along a
scheduler's walk. The grid is one-dimensional: with one CTA per tile it has ``num_tiles`` CTAs
and each CTA's loop runs once; a persistent grid has one CTA per SM, and each walks several.
Every scheduler offers the same interface, so a kernel's roles never ask which walk they are on:

* ``first()``: this CTA's first tile index (its block index); an index ``>= num_tiles`` ends
  the CTA's loop;
* ``decode(idx)`` -> ``WorkTile``;
* ``producer_cursor()`` / ``consumer_cursor()``: what the loading warp / the computing
  warpgroups carry from tile to tile (the hand-off's pipeline state for claimed tiles, else
  None), to be passed to and rebound from
* ``producer_next(idx, cursor)`` / ``consumer_next(idx, cursor)`` -> ``(next index, cursor)``:
  the next tile, as the loading warp and as the computing warpgroups learn it.

The cursor is returned rather than kept in the scheduler because pipeline state advanced in a
staged loop must be a plain local of that loop.

Walks:

* ``StaticTileScheduler``: the query tile fastest, so CTAs running together share a head's K/V
  in L2; under causal-like masks from the last (costliest) query tile down. A persistent grid
  over such tiles walks them sorted by cost (every head's last query tile first) and deals
  them out as a snake (``snake_next``), so each CTA's total lands close to the mean.
* ``ClaimingTileScheduler``: the one-CTA-per-tile order on a persistent grid; a CTA claims its
  next tile from a counter in global memory as it starts loading the current one, and hands the
  claim to its consumers through shared memory (``TileHandOff``). The balance is that of one
  CTA per tile, and the next tile's loads overlap the current tile's compute.
* ``TileTableScheduler``: varlen; walks the list of the query tiles that hold rows, costliest
  first, heads fastest: the host's (``fmha.work_tiles``) or the GPU's (``device_tile_list``).
"""

from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, pipeline


class WorkTile(NamedTuple):
    m_block: Int32
    head: Int32
    batch: Int32


def snake_next(idx, grid):
    """The tile after ``idx`` for its CTA in a snake deal: rounds of ``grid`` tiles, dealt to CTAs
    0 .. grid-1 and then back from grid-1 to 0 (plain arithmetic: the tests run it on ints)."""
    seat = idx % grid  # this CTA's place in the current round
    return idx - seat + grid + (grid - 1 - seat)


def cost_sorted_tile(idx, num_m_blocks, heads_batches):
    """(m_block, head-batch index) of tile ``idx`` in the cost-sorted walk: the query tile
    slowest, from the last query tile (the costliest under a causal-like mask) down, every
    head-batch's before the next query tile. Plain arithmetic: the tests run it on ints."""
    return num_m_blocks - 1 - idx // heads_batches, idx % heads_batches


def m_fastest_tile(idx, num_m_blocks, num_heads, longest_first: bool):
    """(m_block, head, batch) of tile ``idx`` when the query tile index varies fastest (from the
    last query tile down with ``longest_first``). Plain arithmetic: the tests run it on ints."""
    m = idx % num_m_blocks
    rest = idx // num_m_blocks
    if longest_first:
        m = num_m_blocks - 1 - m
    return m, rest % num_heads, rest // num_heads


class _GridStride:
    """The walk of the static schedulers: CTA ``b`` starts at tile ``b``; then either ``b + grid,
    b + 2 * grid, ...`` or, when ``snake`` (tiles sorted costliest first), the snake deal of
    ``snake_next``. Producer and consumers step alike. With one CTA per tile both walks end
    after the first tile."""

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def _next(self, idx: Int32) -> Int32:
        grid = Int32(cute.arch.grid_dim()[0])
        if cutlass.const_expr(self.snake):
            return snake_next(idx, grid)
        return idx + grid

    def producer_cursor(self):
        return None

    def consumer_cursor(self):
        return None

    def producer_next(self, idx: Int32, cursor):
        return self._next(idx), cursor

    def consumer_next(self, idx: Int32, cursor):
        return self._next(idx), cursor


# Frozen: the DSL then treats it as read-only inside dynamic loops instead of loop-carried state.
@dataclass(frozen=True)
class StaticTileScheduler(_GridStride):
    num_m_blocks: Int32
    num_heads: Int32
    heads_batches: Int32
    num_tiles: Int32
    longest_first: bool
    m_slowest: bool  # walk the tiles sorted by cost (``cost_sorted_tile``), dealt out as a snake

    @property
    def snake(self) -> bool:
        return self.m_slowest

    @staticmethod
    def create(num_m_blocks, num_heads, num_batches, longest_first: bool,
               persistent: bool = False) -> "StaticTileScheduler":
        heads_batches = num_heads * num_batches
        return StaticTileScheduler(num_m_blocks, num_heads, heads_batches, num_m_blocks * heads_batches,
                                   longest_first, longest_first and persistent)

    def decode(self, idx: Int32) -> WorkTile:
        if cutlass.const_expr(self.m_slowest):
            m, rest = cost_sorted_tile(idx, self.num_m_blocks, self.heads_batches)
            return WorkTile(m, rest % self.num_heads, rest // self.num_heads)
        return WorkTile(*m_fastest_tile(idx, self.num_m_blocks, self.num_heads, self.longest_first))


@dataclass(frozen=True)
class TileHandOff:
    """Claimed tile indices on their way from the producer warp to the consumer warpgroups: a
    ring of ``STAGES`` shared-memory entries (one per tile a CTA holds at once: the current one
    and, with two Q buffers, the next) under an mbarrier pipeline. Every consumer thread reads
    the entry before it releases it, which orders its read before the producer's next write."""

    producer: pipeline.PipelineProducer
    consumer: pipeline.PipelineConsumer
    entries: cute.Tensor

    STAGES = 2

    @staticmethod
    def create(barrier_storage, entries: cute.Tensor, consumer_threads: int) -> "TileHandOff":
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        producer, consumer = pipeline.PipelineAsync.create(
            num_stages=TileHandOff.STAGES, producer_group=one_thread,
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads),
            barrier_storage=barrier_storage, defer_sync=True,
        ).make_participants()
        return TileHandOff(producer, consumer, entries)


@dataclass(frozen=True)
class ClaimingTileScheduler:
    """Persistent CTAs over the one-CTA-per-tile order (``m_fastest_tile``): CTA ``b`` starts at
    tile ``b``; then its producer warp claims the next tile with an atomic add on ``counter``
    (zeroed before the launch; claim ``c`` is tile ``grid + c``) and passes it on through
    ``hand_off``. A CTA's last claim is past the end, so a launch adds exactly ``num_tiles`` to
    the counter."""

    num_m_blocks: Int32
    num_heads: Int32
    num_tiles: Int32
    longest_first: bool
    counter: cute.Tensor  # (1,) int32 in global memory
    hand_off: TileHandOff

    @staticmethod
    def create(num_m_blocks, num_heads, num_batches, longest_first: bool, counter,
               hand_off: TileHandOff) -> "ClaimingTileScheduler":
        return ClaimingTileScheduler(num_m_blocks, num_heads, num_m_blocks * num_heads * num_batches,
                                     longest_first, counter, hand_off)

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def decode(self, idx: Int32) -> WorkTile:
        return WorkTile(*m_fastest_tile(idx, self.num_m_blocks, self.num_heads, self.longest_first))

    def producer_cursor(self) -> pipeline.PipelineProducer:
        return self.hand_off.producer

    def consumer_cursor(self) -> pipeline.PipelineConsumer:
        return self.hand_off.consumer

    @cute.jit
    def producer_next(self, idx: Int32, cursor: pipeline.PipelineProducer):
        """Claim the next tile and publish it; every lane of the producer warp calls this."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(self.counter.iterator, Int32(1))
        claimed = cute.arch.shuffle_sync(claimed, 0) + Int32(cute.arch.grid_dim()[0])
        handle = cursor.acquire_and_advance()
        with cute.arch.elect_one():
            self.hand_off.entries[handle.index] = claimed
            handle.commit()
        return claimed, cursor

    @cute.jit
    def consumer_next(self, idx: Int32, cursor: pipeline.PipelineConsumer):
        """The tile the producer claimed after ``idx``."""
        handle = cursor.wait_and_advance()
        claimed = self.hand_off.entries[handle.index]
        handle.release()
        return claimed, cursor


@dataclass(frozen=True)
class TileTableScheduler(_GridStride):
    """Varlen: walks the host's list of (batch, m_block) work tiles (``fmha.work_tiles``,
    costliest first, so dealt as a snake) with the heads varying fastest, so CTAs running
    together share a sequence's K/V (in L2) and only query tiles that hold rows are launched."""

    table: cute.Tensor  # (N, 2) int32: batch, m_block
    num_heads: Int32
    num_tiles: Int32
    snake = True

    @staticmethod
    def create(table: cute.Tensor, num_heads, count=None) -> "TileTableScheduler":
        """``count``: (1,) int32 in global memory, the number of entries (a list built on the
        GPU fills only the start of its table); None: all of them."""
        entries = table.shape[0] if count is None else cutlass.min(count[0], table.shape[0])
        return TileTableScheduler(table, num_heads, entries * num_heads)

    def decode(self, idx: Int32) -> WorkTile:
        entry = idx // self.num_heads
        return WorkTile(self.table[entry, 1], idx % self.num_heads, self.table[entry, 0])
