"""NSA's block geometry (docs/nsa.md, "Definition") and the packed layout every branch works in.

Positions are counted from 0 inside a sequence. With compression block ``block`` (l), stride
``stride`` (d) and selection block ``select_block`` (l'):

- compressed block ``i`` covers tokens ``[i*d, i*d + l)``; a sequence of ``T`` tokens has
  ``max(0, (T - l) // d + 1)`` of them; query ``t`` sees block ``i`` iff ``i*d + l - 1 <= t``;
- selection block ``j`` covers tokens ``[j*l', (j+1)*l')`` (the last one may be short); a
  sequence has ``ceil(T / l')`` of them.

The helpers take Python ints or integer tensors alike and never read a tensor on the host, so
they trace under torch.compile.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

__all__ = [
    "num_compressed_blocks",
    "visible_compressed_blocks",
    "num_selection_blocks",
    "compressed_cu_seqlens",
    "dense_cu_seqlens",
    "TokenPositions",
    "token_positions",
    "Packed",
    "pack",
    "NSABranches",
]


def num_compressed_blocks(length, block: int, stride: int):
    """Compressed blocks of a sequence of ``length`` tokens: max(0, (length - l) // d + 1)."""
    n = (length - block) // stride + 1
    return n.clamp(min=0) if torch.is_tensor(n) else max(n, 0)


def visible_compressed_blocks(position, block: int, stride: int):
    """How many compressed blocks query ``position`` sees: blocks ``0 .. count-1``, those with
    ``i*d + l - 1 <= t``. It never exceeds the sequence's block count (``t <= T - 1``)."""
    return num_compressed_blocks(position + 1, block, stride)


def num_selection_blocks(length, select_block: int):
    """Selection blocks of a sequence of ``length`` tokens: ceil(length / l')."""
    return (length + select_block - 1) // select_block


def compressed_cu_seqlens(cu_seqlens: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """The offsets of the compressed sequences (int32, length B + 1) that ``mean_pool`` packs."""
    counts = num_compressed_blocks((cu_seqlens[1:] - cu_seqlens[:-1]).long(), block, stride)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


def dense_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """The offsets of ``batch`` sequences of ``length`` tokens each, as a dense tensor packs."""
    return (torch.arange(batch + 1, dtype=torch.int32, device=device) * length).to(torch.int32)


class TokenPositions(NamedTuple):
    """Per packed token: its sequence's first row, its position in the sequence, its sequence's
    length, and which sequence it is in (int64 tensors of length T; ``sequence`` may be None)."""

    start: torch.Tensor
    position: torch.Tensor
    length: torch.Tensor
    sequence: Optional[torch.Tensor] = None


def token_positions(cu_seqlens: torch.Tensor, total: int) -> TokenPositions:
    """Where each of the ``total`` packed rows sits, from the offsets alone (no host read)."""
    cu = cu_seqlens.long()
    rows = torch.arange(total, device=cu.device)
    # Sequence b holds rows [cu[b], cu[b+1]); searching the ends finds b even past empty ones.
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=max(cu.numel() - 2, 0))
    start = cu[seq]
    return TokenPositions(start, rows - start, cu[seq + 1] - start, seq)


class Packed(NamedTuple):
    """Tensors of one call in the packed (THD) layout; ``batch``/``length`` are the dense
    (B, S) they came from, or None when they came packed."""

    tensors: tuple
    cu_seqlens: torch.Tensor
    batch: Optional[int]
    length: Optional[int]

    def unpack(self, t: Optional[torch.Tensor], length: Optional[int] = None) -> Optional[torch.Tensor]:
        """A packed result (B*S, ...) back as (B, S, ...) for dense inputs (``length``: another S,
        the compressed one)."""
        if t is None or self.batch is None:
            return t
        return t.reshape((self.batch, self.length if length is None else length) + tuple(t.shape[1:]))

    def unpack_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """A packed LSE (H_q, B*S) back as fmha lays out a dense one: (B, H_q, S)."""
        if self.batch is None:
            return lse
        return lse.reshape(lse.shape[0], self.batch, self.length).transpose(0, 1)


def pack(tensors, cu_seqlens: Optional[torch.Tensor]) -> Packed:
    """Dense tensors (B, S, ...) flattened to (B*S, ...) with their offsets (all share B and S),
    or packed ones as they are. ``tensors`` may hold None (passed through)."""
    if cu_seqlens is not None:
        return Packed(tuple(tensors), cu_seqlens, None, None)
    first = tensors[0]
    batch, length = first.shape[0], first.shape[1]
    flat = tuple(None if t is None else t.reshape((batch * length,) + tuple(t.shape[2:])) for t in tensors)
    return Packed(flat, dense_cu_seqlens(batch, length, first.device), batch, length)


class NSABranches(NamedTuple):
    """Each branch's result, in the caller's layout: outputs (tokens, H_q, D_v), LSEs (H_q, T)
    packed or (B, H_q, S) dense as fmha lays LSEs out, ``selected`` (tokens, H_k, n) int32, the
    compressed keys and values, and their offsets (None for dense inputs)."""

    o_cmp: torch.Tensor
    lse_cmp: torch.Tensor
    o_slc: torch.Tensor
    lse_slc: torch.Tensor
    o_win: torch.Tensor
    lse_win: torch.Tensor
    selected: torch.Tensor
    k_cmp: torch.Tensor
    v_cmp: torch.Tensor
    cu_seqlens_cmp: Optional[torch.Tensor]
