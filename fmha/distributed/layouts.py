"""Where each rank's shard of a sequence lies in it: the contiguous and zigzag layouts, for
dense sequences and packed documents, and the conversions between full tensors and shards."""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

LAYOUTS = ("contiguous", "zigzag")


# ---------------------------------------------------------------------------- layouts


def segments(layout: str, rank: int, world: int, local_len: int) -> List[Tuple[int, int, int]]:
    """(global start, local start, length) of the pieces of rank ``rank``'s shard."""
    if layout == "contiguous":
        return [(rank * local_len, 0, local_len)]
    half = local_len // 2
    return [(rank * half, 0, half), ((2 * world - 1 - rank) * half, half, half)]


def shard(x: torch.Tensor, rank: int, world: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full tensor ``x`` (sequence along ``dim``)."""
    _check_layout_name(layout)
    total = x.shape[dim]
    parts = 2 * world if layout == "zigzag" else world
    if total % parts:
        raise ValueError(f"a {layout} layout over {world} ranks needs the sequence length ({total}) to be a "
                         f"multiple of {parts}")
    local = total // world
    return torch.cat([x.narrow(dim, g, n) for g, _, n in segments(layout, rank, world, local)], dim=dim)


def unshard(shards: List[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order)."""
    _check_layout_name(layout)
    world, local = len(shards), shards[0].shape[dim]
    pieces = []
    for r, s in enumerate(shards):
        pieces += [(g, s.narrow(dim, l0, n)) for g, l0, n in segments(layout, r, world, local)]
    return torch.cat([p for _, p in sorted(pieces, key=lambda gp: gp[0])], dim=dim)


def _check_layout_name(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _offsets_list(cu_seqlens) -> List[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        from ..validation import _read_offsets

        return [int(c) for c in _read_offsets(cu_seqlens)]
    return [int(c) for c in cu_seqlens]


def _check_document_lengths(offsets: Sequence[int], world: int, layout: str) -> None:
    """Every document cut into equal chunks: its length a multiple of 2 N (zigzag) or N."""
    _check_layout_name(layout)
    if not offsets or offsets[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {list(offsets[:1])}")
    parts = 2 * world if layout == "zigzag" else world
    for b, (a, e) in enumerate(zip(offsets[:-1], offsets[1:])):
        if e < a:
            raise ValueError(f"cu_seqlens must be nondecreasing: cu_seqlens[{b + 1}] = {e} < cu_seqlens[{b}] = {a}")
        if (e - a) % parts:
            raise ValueError(f"document {b} has {e - a} tokens: a {layout} layout over {world} ranks cuts every "
                             f"document into {parts} equal chunks, so each length must be a multiple of {parts}")


def varlen_segments(layout: str, rank: int, world: int, cu_seqlens) -> List[Tuple[int, int, int]]:
    """(global start, local start, length) of the pieces of rank ``rank``'s shard of packed
    documents with global offsets ``cu_seqlens``: every document cut like a whole sequence, the
    shard the concatenation over documents (its local offsets are ``cu_seqlens // world``)."""
    offsets = _offsets_list(cu_seqlens)
    _check_document_lengths(offsets, world, layout)
    pieces = []
    for a, e in zip(offsets[:-1], offsets[1:]):
        pieces += [(a + g, a // world + loc, n) for g, loc, n in segments(layout, rank, world, (e - a) // world)]
    return pieces


def shard_varlen(x: torch.Tensor, cu_seqlens, rank: int, world: int, layout: str = "zigzag",
                 dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s shard of packed documents ``x`` (tokens along ``dim``, global offsets
    ``cu_seqlens``): each document cut into 2 N (zigzag) or N (contiguous) equal chunks."""
    offsets = _offsets_list(cu_seqlens)
    _check_document_lengths(offsets, world, layout)
    if x.shape[dim] != offsets[-1]:
        raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim} but cu_seqlens[-1] = {offsets[-1]}")
    pieces = [x.narrow(dim, g, n) for g, _, n in varlen_segments(layout, rank, world, offsets) if n]
    return torch.cat(pieces, dim=dim) if pieces else x.narrow(dim, 0, 0)


def unshard_varlen(shards: List[torch.Tensor], cu_seqlens, layout: str = "zigzag", dim: int = 0) -> torch.Tensor:
    """The packed documents from every rank's shard (in rank order)."""
    offsets = _offsets_list(cu_seqlens)
    world = len(shards)
    _check_document_lengths(offsets, world, layout)
    pieces = []
    for r, s in enumerate(shards):
        pieces += [(g, s.narrow(dim, l0, n)) for g, l0, n in varlen_segments(layout, r, world, offsets) if n]
    if not pieces:
        return shards[0].narrow(dim, 0, 0)
    return torch.cat([p for _, p in sorted(pieces, key=lambda gp: gp[0])], dim=dim)
