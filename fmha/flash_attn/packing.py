"""FlashAttention-4's varlen layouts, re-expressed as fmha's packed (THD) calls.

``flash_attn_varlen_func`` describes each side of a batch in one of several ways: packed rows
with ``cu_seqlens``, a dense (B, S, H, D) tensor, ``seqused_q``/``seqused_k`` (only the first
rows of each sequence count), or, for keys, a paged cache with a ``page_table``. fmha's
``attention_varlen`` takes one layout: packed rows, sequence b at ``cu[b]:cu[b + 1]``. Every
combination is that layout after a gather: the rows each sequence uses are copied (with
``index_select``, so gradients flow back to the original tensors) into packed tensors, fmha
attends them with bottom-right masks per sequence, and the output rows go back where the
queries came from. Query rows no sequence uses come back as O = 0 and LSE = -inf
(FlashAttention leaves them unwritten).

The lengths are read on the host (one sync per call) and checked there: a ``seqused`` longer
than its sequence, or a page-table entry outside the cache, is a ``ValueError`` before any
attention runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

import fmha


@dataclass
class Rows:
    """Where one side's sequences lie in a flat (rows, H, D) tensor: ``lengths[b]`` rows each,
    at the flat rows ``index`` (all sequences in order), or at ``0 .. sum(lengths)`` in order
    when ``index`` is None (the tensor is already packed that way)."""

    lengths: List[int]
    index: Optional[torch.Tensor]

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def take(self, flat: torch.Tensor) -> torch.Tensor:
        """The used rows of ``flat``, packed."""
        if self.index is None:
            return flat if flat.shape[0] == self.total else flat[: self.total]
        return flat.index_select(0, self.index)

    def offsets(self, device: torch.device) -> torch.Tensor:
        """cu_seqlens of the packed rows (int32)."""
        cu = [0]
        for n in self.lengths:
            cu.append(cu[-1] + n)
        return torch.tensor(cu, dtype=torch.int32, device=device)


def _offsets_spans(name: str, cu: torch.Tensor, rows: int):
    """(starts, lengths) of the sequences of a cu_seqlens tensor over ``rows`` rows."""
    offsets = cu.tolist()  # host sync: the gather needs the lengths
    if not offsets:
        raise ValueError(f"{name} must have B + 1 entries, got none")
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ValueError(f"{name} must be nondecreasing: {name}[{b + 1}] = {offsets[b + 1]} < "
                             f"{name}[{b}] = {offsets[b]}")
    if offsets[-1] > rows:
        raise ValueError(f"{name}[-1] = {offsets[-1]} but the tensor has only {rows} rows")
    return offsets[:-1], [b - a for a, b in zip(offsets[:-1], offsets[1:])]


def _used_lengths(name: str, seqused: Optional[torch.Tensor], available: List[int], what: str) -> List[int]:
    """``seqused`` read and checked against the rows each sequence has, or ``available``."""
    if seqused is None:
        return available
    used = seqused.tolist()  # host sync, as for cu_seqlens
    for b, (n, cap) in enumerate(zip(used, available)):
        if n < 0 or n > cap:
            raise ValueError(f"{name}[{b}] = {n} but sequence {b} has {cap} {what}; "
                             f"{name} must be between 0 and that")
    return used


def span_index(starts: List[int], lengths: List[int], device: torch.device):
    """(flat row, sequence, position in it) of every used row, for sequences at ``starts``."""
    total = sum(lengths)
    lens = torch.tensor(lengths, dtype=torch.long, device=device)
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=device), lens, output_size=total)
    first = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=device) - first[seq]
    start = torch.tensor(starts, dtype=torch.long, device=device)
    return start[seq] + pos, seq, pos


def _packed_in_order(starts: List[int], lengths: List[int]) -> bool:
    at = 0
    for s, n in zip(starts, lengths):
        if n and s != at:
            return False
        at += n
    return True


def spans(starts: List[int], lengths: List[int], device: torch.device) -> Rows:
    """Rows of sequences that start at ``starts`` in a flat tensor."""
    if _packed_in_order(starts, lengths):
        return Rows(lengths, None)
    return Rows(lengths, span_index(starts, lengths, device)[0])


def paged_spans(page_table: torch.Tensor, lengths: List[int], page_size: int, num_pages: int) -> Rows:
    """Rows of paged sequences in the flattened (num_pages * page_size, H, D) cache: position p of
    sequence b is row ``page_table[b, p // page_size] * page_size + p % page_size``."""
    device = page_table.device
    _, seq, pos = span_index([0] * len(lengths), lengths, device)
    pages = page_table[seq, pos // page_size].long()
    bad = (pages < 0) | (pages >= num_pages)
    if bool(bad.any()):
        at = int(torch.nonzero(bad)[0, 0])
        b, col = int(seq[at]), int(pos[at]) // page_size
        raise ValueError(f"page_table[{b}, {col}] = {int(page_table[b, col])} is not a page of k/v "
                         f"(0 .. {num_pages - 1}), and sequence {b} uses it (it has {lengths[b]} keys)")
    return Rows(lengths, pages * page_size + pos % page_size)


def query_rows(q: torch.Tensor, cu_seqlens_q, seqused_q, batch: int):
    """(flat q, Rows) of the query side: packed (T, H, D) with cu_seqlens_q, or dense (B, S, H, D)."""
    if cu_seqlens_q is not None:
        starts, avail = _offsets_spans("cu_seqlens_q", cu_seqlens_q, q.shape[0])
        flat = q
    else:
        seqlen = q.shape[1]
        starts, avail = [b * seqlen for b in range(batch)], [seqlen] * batch
        flat = q.reshape(batch * seqlen, *q.shape[2:])
    lengths = _used_lengths("seqused_q", seqused_q, avail, "query rows")
    return flat, spans(starts, lengths, q.device)


def key_rows(k: torch.Tensor, v: torch.Tensor, cu_seqlens_k, seqused_k, page_table, batch: int):
    """(flat k, flat v, Rows) of the key side: paged with page_table, packed with cu_seqlens_k,
    or dense (B, S_k, H_k, D)."""
    if page_table is not None:
        num_pages, page_size = k.shape[0], k.shape[1]
        capacity = page_table.shape[1] * page_size
        lengths = _used_lengths("seqused_k", seqused_k, [capacity] * batch,
                                "key positions (page_table columns x page size)")
        rows = paged_spans(page_table, lengths, page_size, num_pages)
        return k.reshape(num_pages * page_size, *k.shape[2:]), v.reshape(num_pages * page_size, *v.shape[2:]), rows
    if cu_seqlens_k is not None:
        starts, avail = _offsets_spans("cu_seqlens_k", cu_seqlens_k, k.shape[0])
        flat_k, flat_v = k, v
    else:
        seqlen = k.shape[1]
        starts, avail = [b * seqlen for b in range(batch)], [seqlen] * batch
        flat_k = k.reshape(batch * seqlen, *k.shape[2:])
        flat_v = v.reshape(batch * seqlen, *v.shape[2:])
    lengths = _used_lengths("seqused_k", seqused_k, avail, "keys")
    return flat_k, flat_v, spans(starts, lengths, k.device)


def _place(packed: torch.Tensor, rows: Rows, flat_rows: int, dim: int, fill: float) -> torch.Tensor:
    """``packed`` rows (along ``dim``) put back at their flat rows; ``fill`` elsewhere."""
    if rows.index is None and packed.shape[dim] == flat_rows:
        return packed
    shape = list(packed.shape)
    shape[dim] = flat_rows
    full = packed.new_full(shape, fill)
    index = rows.index if rows.index is not None else torch.arange(rows.total, device=packed.device)
    return full.index_copy(dim, index, packed)


def attend_gathered(q, k, v, *, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table, batch: int,
                    want_lse: bool, **fmha_kwargs):
    """Attention of any FlashAttention-4 varlen layout through ``fmha.attention_varlen``.
    Returns (O, LSE or None) laid out as FlashAttention returns them: O like q with D_v, LSE
    (H, T_q) for packed queries, (B, H, S_q) for dense ones."""
    flat_q, q_rows = query_rows(q, cu_seqlens_q, seqused_q, batch)
    flat_k, flat_v, k_rows = key_rows(k, v, cu_seqlens_k, seqused_k, page_table, batch)
    device = q.device
    result = fmha.attention_varlen(
        q_rows.take(flat_q), k_rows.take(flat_k), k_rows.take(flat_v), q_rows.offsets(device),
        k_rows.offsets(device), max_seqlen_q=max(q_rows.lengths, default=0),
        max_seqlen_k=max(k_rows.lengths, default=0), return_lse=want_lse, **fmha_kwargs)
    out, lse = result if want_lse else (result, None)
    out = _place(out, q_rows, flat_q.shape[0], 0, 0.0)
    if lse is not None:
        lse = _place(lse, q_rows, flat_q.shape[0], 1, -math.inf)
    if cu_seqlens_q is None:  # back to the dense layout
        seqlen = q.shape[1]
        out = out.view(batch, seqlen, *out.shape[1:])
        if lse is not None:
            lse = lse.view(lse.shape[0], batch, seqlen).permute(1, 0, 2).contiguous()
    return out, lse
