"""Host side of varlen scheduling: the list of query tiles that exist, costliest first (and for
the backward, of K/V tiles: ``kv_work_tiles``).

A varlen launch sized by the longest sequence would give every sequence ``max_seqlen_q / tile_m``
query tiles, most of them empty, and a static split of those over the SMs is unbalanced because
tile costs follow each sequence's key count. Validation has already read the sequence lengths on
the host, so the launcher lists the (sequence, query tile) pairs that hold rows, ordered by
the number of K/V tiles they visit (the same ``kv_walk`` the kernel runs), largest
first: one CTA per tile then runs longest-processing-time-first, and a persistent grid deals
the list out as a snake (``scheduler.snake_next``), which gives every CTA about the same work.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from .kernels.common.kv_walk import kv_walk
from .masking import MaskSpec, num_q_tiles, row_key_bounds

_DEVICE_CACHE: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_CACHE_SIZE = 64
# Tables a CUDA graph captured (data pointer -> (table, pinned source)): every replay reads them,
# so neither leaves memory while the process lives.
_HELD_BY_GRAPHS: dict = {}


def _stream_of(device: torch.device):
    """The current stream of a CUDA device (None elsewhere). Tables are cached per stream: one is
    made and read on the same stream, so its copy is ordered before the kernels that read it, and
    when the cache drops it the allocator reuses the memory only behind those kernels."""
    return torch.cuda.current_stream(device).stream_id if device.type == "cuda" else None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def work_tiles(seqlens_q: Sequence[int], seqlens_k: Sequence[int], mask: MaskSpec,
               tile_m: int, tile_n: int) -> list:
    """[(batch, m_block)] for every query tile with rows, costliest first (ties: batch, m_block)."""
    items = []
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        for m in range(num_q_tiles(sq, tile_m)):
            sched = kv_walk(m, tile_m, tile_n, sq, sk, mask.kind, mask.window_left, mask.window_right,
                            mask.bottom_right, compression=mask.compression)
            # +1: a tile that visits no K/V still loads Q and writes O and LSE
            items.append((-(sched.total + 1), b, m))
    items.sort()
    return [(b, m) for _, b, m in items]


def work_tile_table(seqlens_q, seqlens_k, mask: MaskSpec, tile_m: int, tile_n: int,
                    device: torch.device) -> torch.Tensor:
    """``work_tiles`` as an int32 (N, 2) tensor on ``device`` (cached: repeated batch shapes,
    as in serving or training loops, pay for neither the Python loop nor the copy again).
    N is at least 1 so the kernel argument always has a valid address: with no rows at all the
    table is [(0, 0)], a tile the kernel finds empty and skips."""
    return _cached_table(work_tiles, seqlens_q, seqlens_k, mask, tile_m, tile_n, device)


def _cached_table(list_tiles, seqlens_q, seqlens_k, mask: MaskSpec, tile_m: int, tile_n: int,
                  device: torch.device) -> torch.Tensor:
    """``list_tiles(...)`` as a cached int32 (N >= 1, 2) tensor on ``device``, made on the
    current stream (``_stream_of``). Under CUDA-graph capture a cached table of any stream serves
    and is kept for good (the graph reads it at every replay): that needs the device synchronized
    before the capture, as ``torch.cuda.graph`` does (a bare ``CUDAGraph.capture_begin`` does
    not). A new one is not cached: its copy runs only when the graph replays, so an eager call
    must not find it before; each such call adds its own copy to the graph, so warm up on the
    same lengths before capturing. Held tables stay for the life of the process."""
    device = torch.device(device)
    key = (list_tiles.__name__, tuple(seqlens_q), tuple(seqlens_k), mask, tile_m, tile_n, str(device),
           _stream_of(device))
    capturing = _capturing(device)
    table = _DEVICE_CACHE.get(key)
    if table is None and capturing:
        # a table an eager call made on another stream: torch.cuda.graph synchronizes the device
        # before it captures, so that table's copy has run
        key = next((k for k in _DEVICE_CACHE if k[:-1] == key[:-1]), key)
        table = _DEVICE_CACHE.get(key)
    if table is not None:
        _DEVICE_CACHE.move_to_end(key)
        if capturing:
            _HELD_BY_GRAPHS.setdefault(table.data_ptr(), (table, None))
        return table
    tiles = list_tiles(seqlens_q, seqlens_k, mask, tile_m, tile_n)
    table = source = torch.tensor(tiles or [(0, 0)], dtype=torch.int32).reshape(-1, 2)
    if device.type == "cuda":  # pinned: the copy does not wait for the GPU
        source = source.pin_memory()
        table = source.to(device, non_blocking=True)
    if capturing:
        _HELD_BY_GRAPHS[table.data_ptr()] = (table, source)  # the replayed copy reads the source
        return table
    _DEVICE_CACHE[key] = table
    if len(_DEVICE_CACHE) > _CACHE_SIZE:
        _DEVICE_CACHE.popitem(last=False)
    return table


def kv_work_tiles(seqlens_q: Sequence[int], seqlens_k: Sequence[int], mask: MaskSpec,
                  tile_m: int, tile_n: int) -> list:
    """The backward's list: [(batch, n_block)] for every K/V tile with keys, the costliest first
    (cost: the query tiles holding a row that keeps one of its keys, plus one; ties: batch,
    n_block). Every such tile is listed, even one no row keeps: it writes dK = dV = 0."""
    items = []
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        num_n = -(-sk // tile_n)
        starts = [0] * (num_n + 1)  # a difference array: query tile m adds 1 over its K/V tiles
        for m in range(num_q_tiles(sq, tile_m)):
            first, last = m * tile_m, min(m * tile_m + tile_m, sq) - 1
            # bands never move left as the row grows: the tile's keys lie in [first's lo, last's hi)
            lo = row_key_bounds(first, sq, sk, mask.kind, mask.window_left, mask.window_right, mask.bottom_right,
                                compression=mask.compression)[0]
            hi = row_key_bounds(last, sq, sk, mask.kind, mask.window_left, mask.window_right, mask.bottom_right,
                                compression=mask.compression)[1]
            n_lo, n_hi = max(lo, 0) // tile_n, -(-min(hi, sk) // tile_n)
            if n_lo < n_hi:
                starts[n_lo] += 1
                starts[n_hi] -= 1
        visits = 0
        for n in range(num_n):
            visits += starts[n]
            items.append((-(visits + 1), b, n))
    items.sort()
    return [(b, n) for _, b, n in items]


def kv_work_tile_table(seqlens_q, seqlens_k, mask: MaskSpec, tile_m: int, tile_n: int,
                       device: torch.device) -> torch.Tensor:
    """``kv_work_tiles`` as an int32 (N, 2) tensor on ``device``, cached as ``work_tile_table``'s."""
    return _cached_table(kv_work_tiles, seqlens_q, seqlens_k, mask, tile_m, tile_n, device)
