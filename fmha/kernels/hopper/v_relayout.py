"""Where the forward's in-kernel fp8 V transpose (``HopperAttentionForward.transpose_v``) reads
and writes shared memory: 8-byte words of a raw V stage (keys x D, D contiguous, as TMA loads
it) and 4-byte words of a K/V ring stage (D x slots, slots contiguous, as the P.V product reads
it), with the layouts' swizzles applied by hand.

A CuTe swizzle ``S<B, 4, 3>`` XORs bits 7.. of a byte offset (a row of the swizzle atom) into
bits 4.. (its 16-byte column). A key row's swizzle bits come from its row alone, so they are
computed once per thread (``base`` is even: the four keys' rows add to it without a carry); a
head-dim row's come from its index mod 8, known per store. What varies per chunk is then one add
and one XOR, where indexing the swizzled views computed every address in full.

Plain arithmetic, so it runs on the kernel's ``Int32`` values and on Python ints: the tests check
it against the layouts' own offsets (``cute.crd2idx`` of the swizzled layouts).
"""

from dataclasses import dataclass
from typing import Any

from ..common.fp8_order import FP8_KEY_ORDER

#: keys of a slot word (slots 4w..4w+3) relative to its first: FP8_KEY_ORDER in fours
KEY_OFFSETS = (0, 1, 8, 9)
assert all(FP8_KEY_ORDER[4 * w + i] - FP8_KEY_ORDER[4 * w] == KEY_OFFSETS[i] for w in range(8) for i in range(4))
assert all(FP8_KEY_ORDER[4 * w] == 16 * (w // 4) + 2 * (w % 4) for w in range(8))


def transpose_4x4_bytes(prmt, a, b, c, d):
    """Four words of 4 bytes each (one per key) -> four words, word j holding byte j of a, b, c,
    d; ``prmt`` is ``cute.arch.prmt`` (or a model of it)."""
    ab_lo, ab_hi = prmt(a, b, 0x5140), prmt(a, b, 0x7362)  # a0 b0 a1 b1 | a2 b2 a3 b3
    cd_lo, cd_hi = prmt(c, d, 0x5140), prmt(c, d, 0x7362)
    return (prmt(ab_lo, cd_lo, 0x5410), prmt(ab_lo, cd_lo, 0x7632),
            prmt(ab_hi, cd_hi, 0x5410), prmt(ab_hi, cd_hi, 0x7632))


def _crd2idx(coord, layout):
    import cutlass.cute as cute

    return cute.crd2idx(coord, layout)


# Frozen: read-only for the DSL's loop analysis.
@dataclass(frozen=True)
class VRelayoutAddresses:
    """Thread ``tid`` of ``threads`` owns slot word ``w`` (slots 4w..4w+3 of every head-dim row:
    keys base, base + 1, base + 8, base + 9 of a block of 32) and every ``chunk_step``-th 16-byte
    head-dim chunk from ``first_chunk`` (``num_chunks`` of them: shared out unevenly). Per chunk
    it loads two halves (8 bytes of each of its four keys) and stores 16 words, one per head-dim
    row. Of the 8 threads of a warp whose key rows share a swizzle phase (w % 4), 4 load each half
    first (``half``; with ``halves_swapped``), so a warp's loads of one key offset spread over
    twice the banks."""

    raw_outer: Any
    ring_outer: Any
    raw_mask: int  # the row bits a swizzle reads
    ring_mask: int
    w: Any
    first_chunk: Any
    chunk_step: int
    num_chunks: Any
    key_row: Any  # bytes: the thread's first key row; the other keys' rows from it (key_rows)
    key_swizzle: Any
    key_rows: tuple
    half: Any
    half_rows: int  # 8 head-dim rows of a ring stage

    @staticmethod
    def create(raw_layout, ring_layout, head_dim: int, tile_n: int, threads: int, tid,
               halves_swapped: bool = True) -> "VRelayoutAddresses":
        words = tile_n // 4
        chunks = head_dim // 16
        assert threads % words == 0, "each chunk's slot words are shared out among whole groups of threads"
        raw_outer, ring_outer = raw_layout.outer, ring_layout.outer
        raw_mask = ((1 << raw_layout.inner.num_bits) - 1) << 7
        w = tid % words
        first_chunk, chunk_step = tid // words, threads // words
        base = 32 * (w // 8) + 16 * (w % 8 // 4) + 2 * (w % 4)
        key_row = _crd2idx((0, base, 0), raw_outer)
        return VRelayoutAddresses(
            raw_outer, ring_outer, raw_mask, ((1 << ring_layout.inner.num_bits) - 1) << 7, w, first_chunk,
            chunk_step, (chunks - first_chunk + chunk_step - 1) // chunk_step, key_row, (key_row & raw_mask) >> 3,
            tuple(_crd2idx((0, off, 0), raw_outer) for off in KEY_OFFSETS), (w // 4) % 2 if halves_swapped else 0,
            _crd2idx((8, 0, 0), ring_outer))

    def chunk(self, k):
        """The thread's ``k``-th chunk."""
        return self.first_chunk + k * self.chunk_step

    def raw_stage(self, stage):
        """8-byte words: the thread's first key row in raw stage ``stage``, at its first half."""
        return ((_crd2idx((0, 0, stage), self.raw_outer) + self.key_row) >> 3) + self.half

    def chunk_in_key_row(self, chunk):
        """Bytes: the chunk in the thread's key rows, swizzled (the first key's swizzle)."""
        return _crd2idx((16 * chunk, 0, 0), self.raw_outer) ^ self.key_swizzle

    def load(self, raw_stage, chunk_in_key_row, i: int, h: int):
        """8-byte word: half ``h ^ half`` of the chunk of key ``base + KEY_OFFSETS[i]``."""
        key_row = self.key_rows[i]
        return (raw_stage + ((key_row + (chunk_in_key_row ^ ((key_row & self.raw_mask) >> 3))) >> 3)) ^ h

    def ring_stage(self, ring_index):
        """Bytes: the thread's slot word in ring stage ``ring_index``."""
        return _crd2idx((0, 0, ring_index), self.ring_outer) + 4 * self.w

    def ring_half(self, ring_stage, chunk, h: int):
        """Bytes, unswizzled: the thread's slot word in head-dim row 16 chunk + 8 (h ^ half)."""
        return ring_stage + _crd2idx((16 * chunk, 0, 0), self.ring_outer) + (self.half ^ h) * self.half_rows

    def store(self, ring_half, c: int, j: int):
        """4-byte word: the slot word in head-dim row 4c + j of the half chunk; the row's swizzle
        is that of 4c + j (the half chunk starts at a multiple of 8 rows)."""
        row = _crd2idx((4 * c + j, 0, 0), self.ring_outer)
        return ((ring_half ^ ((row & self.ring_mask) >> 3)) + row) >> 2
