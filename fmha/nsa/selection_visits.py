"""What NSA's selection kernel visits (``fmha.kernels.hopper`` with ``selection_config``): the
selection lists regrouped by the kernel's query tiles.

The kernel packs each token's GQA group as consecutive rows (``P`` tokens per 64-row tile, one
K/V head per tile), so a tile holds ``P`` tokens whose lists differ. It walks the union of their
lists, one entry per distinct block: the block's first key row in the packed keys (its
sequence's start + ``j * select_block``; blocks longer than the key tile are several entries)
and a word whose bit ``p`` says that the tile's ``p``-th token chose the block. The kernel keeps
the keys of an entry up to each choosing token (``FragmentMask.selected_bounds``). Entries that
every token of the tile keeps whole (all chose it, it ends at or before the first token, and it
fills the key tile) come last and skip the element-wise mask.

Built with tensor ops on the device, without a host sync (CUDA-graph safe). A block an unchecked
list names twice counts once; one that starts after the token keeps nothing and is dropped, as
is every -1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .layout import token_positions

#: a row past every key: unused slots sort last
_NONE = 1 << 40
#: past every (head, chunk, query tile, half, position) key of the backward's lists
_NONE_KEY = 1 << 62


@dataclass(frozen=True)
class SelectionProblem:
    """What a selection kernel is asked (``fmha.backends.SELECTION``): everything it is compiled
    for, and the device; sizes are the call's."""

    dtype: torch.dtype
    head_dim: int
    head_dim_v: int
    heads_q: int
    heads_k: int
    select_block: int
    device: torch.device

    @staticmethod
    def of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, select_block: int) -> "SelectionProblem":
        return SelectionProblem(q.dtype, q.shape[-1], v.shape[-1], q.shape[1], k.shape[1], select_block, q.device)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_k


class SelectionVisits(NamedTuple):
    """Per (batch 1, K/V head, query tile): ``counts[..., 0]`` masked and ``counts[..., 1]`` whole
    entries, listed in that order in ``rows`` (first key row) and ``positions`` (bit p: token
    ``tile * P + p`` chose it); int32, contiguous."""

    counts: torch.Tensor
    rows: torch.Tensor
    positions: torch.Tensor

    def as_lists(self) -> tuple:
        return self.counts, self.rows, self.positions


def selection_visits(selected: torch.Tensor, cu_seqlens: torch.Tensor, select_block: int,
                     tokens_per_tile: int, tile_n: int) -> SelectionVisits:
    """The visits of ``selected`` (T, H_k, n) int32 (blocks of ``select_block`` tokens of each
    token's sequence, -1 unused) over packed tokens with ``cu_seqlens``, for query tiles of
    ``tokens_per_tile`` tokens and key tiles of ``tile_n`` keys (``select_block`` at most
    ``tile_n`` or a multiple of it)."""
    if select_block > tile_n and select_block % tile_n:
        raise ValueError(f"a selection block of {select_block} keys is neither at most one key tile of {tile_n} "
                         f"nor a multiple of it")
    total, heads_k, count = selected.shape
    device = selected.device
    pieces = max(1, select_block // tile_n)  # entries per block
    length = min(select_block, tile_n)  # keys per entry
    where = token_positions(cu_seqlens, total)
    sel = selected.long()
    piece = torch.arange(pieces, device=device) * tile_n
    offset = (sel.clamp(min=0) * select_block)[..., None] + piece  # (T, H_k, n, pieces) from the sequence's start
    position = where.position.view(total, 1, 1, 1).long()
    live = (sel >= 0)[..., None] & (offset <= position)
    rows = torch.where(live, where.start.view(total, 1, 1, 1).long() + offset, torch.full_like(offset, _NONE))
    rows = rows.flatten(2)  # (T, H_k, n * pieces)
    # tiles of P tokens: (H_k, M, P * entries), each entry with its token's place p in the tile
    p = tokens_per_tile
    tiles = -(-total // p) if total else 0
    pad = tiles * p - total
    if pad:
        rows = torch.cat([rows, rows.new_full((pad,) + rows.shape[1:], _NONE)])
    per_token = rows.shape[-1]
    rows = rows.view(tiles, p, heads_k, per_token).permute(2, 0, 1, 3).reshape(heads_k, tiles, p * per_token)
    place = torch.arange(p, device=device).repeat_interleave(per_token)
    # sorted by (row, place): equal rows are adjacent, and a (row, place) named twice is adjacent
    key = rows * p + place
    key = key.sort(dim=-1).values
    rows = key // p
    place = key % p
    used = rows < _NONE
    twice = torch.zeros_like(used)
    twice[..., 1:] = key[..., 1:] == key[..., :-1]
    first = used.clone()
    first[..., 1:] &= rows[..., 1:] != rows[..., :-1]
    slot = first.long().cumsum(-1) - 1  # each entry's distinct block
    width = p * per_token
    slot = torch.where(used, slot, torch.full_like(slot, width))  # unused: a spare last slot
    bits = torch.where(used & ~twice, torch.ones_like(place) << place, torch.zeros_like(place))
    chose = torch.zeros((heads_k, tiles, width + 1), dtype=torch.int64, device=device)
    chose.scatter_add_(2, slot, bits)
    starts = torch.full((heads_k, tiles, width + 1), _NONE, dtype=torch.int64, device=device)
    starts.scatter_(2, torch.where(first, slot, torch.full_like(slot, width)), rows)  # the others: the spare
    chose, starts = chose[..., :width], starts[..., :width]
    # whole: every token of the tile (all of them tokens) chose it, and its keys end at or before
    # the first token (one sequence: no block is chosen across a sequence's start)
    real = (torch.arange(tiles, device=device) * p + p <= total).view(1, tiles, 1)
    all_bits = (1 << p) - 1
    first_token = (torch.arange(tiles, device=device) * p).view(1, tiles, 1)
    whole = (starts < _NONE) & real & (chose == all_bits) & (starts + length - 1 <= first_token) & (length == tile_n)
    rank = torch.where(starts < _NONE, whole.long(), torch.full_like(starts, 2))
    listed = (rank * (_NONE + 1) + starts.clamp(max=_NONE)).argsort(dim=-1)
    rows_out = starts.gather(-1, listed)
    chose_out = chose.gather(-1, listed)
    counts = torch.stack(((rank == 0).sum(-1), (rank == 1).sum(-1)), dim=-1)
    rows_out = torch.where(rows_out < _NONE, rows_out, torch.zeros_like(rows_out))
    # bit 31 (the 32nd token) wraps to the sign as int32; the kernel tests bits, not values
    chose_out = torch.where(chose_out >= 1 << 31, chose_out - (1 << 32), chose_out)
    return SelectionVisits(counts.to(torch.int32)[None].contiguous(), rows_out.to(torch.int32)[None].contiguous(),
                           chose_out.to(torch.int32)[None].contiguous())


#: entries (query tiles) of a K/V tile's list below which it is never split over several CTAs:
#: a split CTA adds its dK and dV in fp32 atomically, which must stay small beside its walk
MIN_PIECE_ENTRIES = 128


class SelectionBackwardVisits(NamedTuple):
    """The backward's lists (``kernels/hopper/bwd.SelectedQueryVisits``): K/V tile n of sequence
    b is chunk ``chunk_base[b] + n``; for K/V head h its entries are ``offsets[h * chunks +
    chunk]`` up to the next offset, the masked ones before ``masked_end[h * chunks + chunk]``; an
    entry is a query tile of the sequence (``tiles``) and, per half of the K/V tile,
    the bits of the tile's positions that chose the block holding that half (``positions``
    (entries, 2)); ``pieces``: over how many CTAs each list is split (``list_pieces``). int32,
    contiguous."""

    chunk_base: torch.Tensor
    offsets: torch.Tensor
    masked_end: torch.Tensor
    tiles: torch.Tensor
    positions: torch.Tensor
    pieces: torch.Tensor


def list_pieces(offsets: torch.Tensor, max_pieces: int, sms: int) -> torch.Tensor:
    """Over how many CTAs (1 to ``max_pieces``) each K/V tile's list is walked: block 0, which
    every position selects, lists every query tile of its sequence, and one CTA walking it would
    outlast the rest of the grid. A list is cut into equal shares of at least
    ``MIN_PIECE_ENTRIES`` and about half of what each of the ``sms`` SMs walks on average; the
    CTAs of a cut list add their dK and dV into fp32 accumulators. int32 per list, from tensor ops
    (no host sync)."""
    counts = (offsets[1:] - offsets[:-1]).long()
    share = (-(-offsets[-1:].long() // (2 * sms))).clamp(min=MIN_PIECE_ENTRIES)
    return (-(-counts // share)).clamp(1, max_pieces).to(torch.int32)


def split_key_rows(visits: SelectionBackwardVisits, cu_seqlens: torch.Tensor, total: int, heads_k: int,
                   tile_n: int) -> torch.Tensor:
    """bool (T, H_k): the keys whose K/V tile's list is split (``list_pieces``), whose dK and dV
    the kernel leaves in the fp32 accumulators."""
    cu = cu_seqlens.long()
    batch = cu.numel() - 1
    where = token_positions(cu_seqlens, total)
    seq = torch.searchsorted(cu[1:], torch.arange(total, device=cu.device), right=True).clamp(max=max(batch - 1, 0))
    chunks = visits.masked_end.numel() // heads_k
    chunk = visits.chunk_base.long()[seq] + where.position // tile_n
    at = torch.arange(heads_k, device=cu.device).view(1, heads_k) * chunks + chunk.view(total, 1)
    return visits.pieces.long()[at] > 1


def selection_backward_visits(selected: torch.Tensor, cu_seqlens: torch.Tensor, select_block: int,
                              tokens_per_tile: int, tile_n: int, max_pieces: int = 1,
                              sms: int = 132) -> SelectionBackwardVisits:
    """What each K/V tile of ``tile_n`` keys (from a sequence's first key on) visits in the
    selection backward: the query tiles of ``tokens_per_tile`` positions (from the sequence's
    first) some position of which chose a block holding the tile's keys, with the bits of those
    positions per half of the tile. ``select_block`` must be a multiple of half a tile, so that
    each half lies in one block. Built with tensor ops on the device, without a host sync; a
    block named twice counts once, -1 and blocks that start after the position are dropped. An
    entry is whole (listed after the masked ones) when every position of the tile chose both
    halves' blocks, the tile of keys is full and ends at or before the first position. A list
    is split over up to ``max_pieces`` CTAs (``list_pieces``, ``sms``: the GPU's SMs)."""
    half = tile_n // 2
    if select_block % half:
        raise ValueError(f"the selection backward takes selection blocks that are multiples of {half} keys (half "
                         f"its key tile), got {select_block}")
    total, heads_k, _ = selected.shape
    device = selected.device
    p = tokens_per_tile
    cu = cu_seqlens.long()
    batch = cu.numel() - 1
    lengths = (cu[1:] - cu[:-1]).clamp(min=0)
    chunk_base = torch.cat([cu.new_zeros(1), ((lengths + tile_n - 1) // tile_n).cumsum(0)])
    chunks = total // tile_n + batch + 1  # at least every sequence's K/V tiles
    where = token_positions(cu_seqlens, total)
    seq = torch.searchsorted(cu[1:], torch.arange(total, device=device), right=True).clamp(max=max(batch - 1, 0))
    position = where.position.view(total, 1, 1, 1)
    pieces = select_block // half
    sel = selected.long()
    unit = sel.clamp(min=0)[..., None] * pieces + torch.arange(pieces, device=device)  # the halves, from the start
    live = (sel >= 0)[..., None] & (unit * half <= position)
    chunk = chunk_base[seq].view(total, 1, 1, 1) + unit // 2
    head = torch.arange(heads_k, device=device).view(1, heads_k, 1, 1)
    tiles_bound = total // p + 1  # query tiles of a sequence, at most
    group = (head * chunks + chunk) * tiles_bound + position // p  # (head, chunk, query tile)
    key = group * (2 * p) + (unit % 2) * p + position % p  # then (half, position in the tile)
    key = torch.where(live, key, torch.full_like(key, _NONE_KEY)).flatten().sort().values
    n = key.numel()
    used = key < _NONE_KEY
    twice = torch.zeros_like(used)
    twice[1:] = key[1:] == key[:-1]
    group = key // (2 * p)
    first = used.clone()
    first[1:] &= group[1:] != group[:-1]
    slot = torch.where(used, first.long().cumsum(0) - 1, torch.full_like(key, n))  # unused: a spare last slot
    side, place = (key % (2 * p)) // p, key % p
    bits = torch.where(used & ~twice, torch.ones_like(place) << place, torch.zeros_like(place))
    words = torch.zeros((n + 1) * 2, dtype=torch.int64, device=device)
    words.scatter_add_(0, slot * 2 + torch.where(used, side, torch.zeros_like(side)), bits)
    words = words.view(n + 1, 2)[:n]
    groups = torch.full((n + 1,), _NONE_KEY, dtype=torch.int64, device=device)
    groups.scatter_(0, torch.where(first, slot, torch.full_like(slot, n)), group)
    groups = groups[:n]
    listed = groups < _NONE_KEY
    at = torch.where(listed, groups // tiles_bound, torch.zeros_like(groups))  # head * chunks + chunk
    m = groups % tiles_bound
    # whole: every position of the tile chose both halves, and the full key tile ends before them
    c = at % chunks
    s = torch.searchsorted(chunk_base[1:], c, right=True).clamp(max=max(batch - 1, 0))
    length = lengths[s] if batch else torch.zeros_like(c)
    first_key = (c - chunk_base[s]) * tile_n
    count = (length - m * p).clamp(0, p)
    everyone = (torch.ones_like(count) << count) - 1
    whole = (listed & (count > 0) & ((words[:, 0] & everyone) == everyone) & ((words[:, 1] & everyone) == everyone)
             & (first_key + tile_n <= length) & (first_key + tile_n - 1 <= m * p))
    order = torch.where(listed, (at * 2 + whole.long()) * tiles_bound + m, torch.full_like(m, _NONE_KEY)).argsort()
    lists = heads_k * chunks
    spare = torch.full_like(at, lists)
    per_list = torch.zeros(lists + 1, dtype=torch.int64, device=device)
    per_list.scatter_add_(0, torch.where(listed, at, spare), listed.long())
    masked = torch.zeros(lists + 1, dtype=torch.int64, device=device)
    masked.scatter_add_(0, torch.where(listed & ~whole, at, spare), (listed & ~whole).long())
    offsets = torch.cat([per_list.new_zeros(1), per_list[:lists].cumsum(0)])
    positions = words[order]
    # bit 31 (the 32nd position) wraps to the sign as int32; the kernel tests bits, not values
    positions = torch.where(positions >= 1 << 31, positions - (1 << 32), positions)
    return SelectionBackwardVisits(chunk_base.to(torch.int32), offsets.to(torch.int32),
                                   (offsets[:-1] + masked[:lists]).to(torch.int32), m[order].to(torch.int32),
                                   positions.to(torch.int32).contiguous(), list_pieces(offsets, max_pieces, sms))


class SelectionBackwardOrder(NamedTuple):
    """What a deterministic selection backward adds in a fixed order by (``bwd.py``,
    ``deterministic``): the K/V tiles listed in sequence order (``tiles`` (N, 2) of (sequence,
    K/V tile), ``count`` (1,)), so that a CTA of a lower index holds a lower K/V tile of the same
    sequence; each list entry's ``turn`` among the K/V tiles that add dQ into its query tile (their
    rank by K/V tile); zeroed counters ``dq_turns`` (1, H_k, dQ accumulator tiles) and
    ``dkv_turns`` (one per list and consumer warpgroup, for a split list's shares, which add dK
    and dV in share order). int32, contiguous."""

    tiles: torch.Tensor
    count: torch.Tensor
    turns: torch.Tensor
    dq_turns: torch.Tensor
    dkv_turns: torch.Tensor


def selection_backward_order(visits: SelectionBackwardVisits, capacity: int, heads_k: int, tile_n: int,
                             dq_tiles: int) -> SelectionBackwardOrder:
    """The fixed order of a deterministic selection backward over ``visits``: room for
    ``capacity`` K/V tiles (those past the last sequence's get a tile past every sequence, which
    has no work), ``dq_tiles`` tiles of the dQ accumulator. Tensor ops on the device, no host
    sync. Every wait it implies is on a CTA of a lower index, which the GPU starts first."""
    device = visits.offsets.device
    chunk_base = visits.chunk_base.long()
    batch = chunk_base.numel() - 1
    c = torch.arange(capacity, device=device)
    seq = torch.searchsorted(chunk_base[1:], c, right=True).clamp(max=max(batch - 1, 0))
    inside = c < chunk_base[-1]
    past = 2 ** 30 // tile_n  # as the kernel's own entries past the count
    tiles = torch.stack([torch.where(inside, seq, torch.zeros_like(seq)),
                         torch.where(inside, c - chunk_base[seq], torch.full_like(c, past))], dim=1)
    # each entry's list (head * chunks + chunk) and its query tile's key (head, sequence, tile)
    offsets = visits.offsets.long()
    lists = offsets.numel() - 1
    chunks = lists // heads_k
    entries = visits.tiles.numel()
    e = torch.arange(entries, device=device)
    at = torch.searchsorted(offsets[1:], e, right=True).clamp(max=max(lists - 1, 0))
    chunk = at % chunks
    sequence = torch.searchsorted(chunk_base[1:], chunk, right=True).clamp(max=max(batch - 1, 0))
    listed = e < offsets[-1]
    query_tile = (((at // chunks) * max(batch, 1) + sequence) << 31) + visits.tiles.long()
    query_tile = torch.where(listed, query_tile, torch.full_like(e, _NONE_KEY))
    # entries are in list order, a head's K/V tiles ascending: a stable sort keeps them so per query tile
    ordered, by_tile = query_tile.sort(stable=True)
    first = torch.ones_like(listed)
    first[1:] = ordered[1:] != ordered[:-1]
    start = torch.where(first, e, torch.zeros_like(e)).cummax(0).values
    turns = torch.empty_like(e)
    turns[by_tile] = e - start
    return SelectionBackwardOrder(
        tiles.to(torch.int32).contiguous(), chunk_base[-1:].to(torch.int32),
        turns.to(torch.int32), torch.zeros((1, heads_k, dq_tiles), dtype=torch.int32, device=device),
        torch.zeros(2 * lists, dtype=torch.int32, device=device))
