"""Each ring step's local attention calls: which (query piece, key piece) blocks of the rank's
shard and the shard in hand the mask keeps, with the window shifted by the pieces' global
offsets, merged into one call where the blocks allow it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple, Union

import torch

from .. import api
from .layouts import segments


# ---------------------------------------------------------------------------- one block


def _block_window(q_start: int, k_start: int, q_len: int, k_len: int, left, right):
    """How the full sequence's window (keys p_k with p_q - left <= p_k <= p_q + right) falls on
    the block of queries ``q_start ..`` and keys ``k_start ..``: None if it keeps nothing, else
    (first query row, first key, local window (left, right)) such that rows before the first keep
    nothing and the rest see ``keys[first key:]`` under the local top-left window."""
    d = q_start - k_start
    lo = -math.inf if left is None else d - left   # row i keeps local keys j with lo <= j - i <= hi
    hi = math.inf if right is None else d + right
    first_row = 0 if hi == math.inf else max(0, -hi)
    if first_row >= q_len or (lo != -math.inf and lo + first_row > k_len - 1):
        return None
    first_key = 0 if lo == -math.inf else max(0, lo + first_row)
    if first_key >= k_len:
        return None
    local_left = None if lo == -math.inf else first_key - (lo + first_row)
    local_right = None if hi == math.inf else (hi + first_row) - first_key
    if local_left is not None and local_left >= k_len - first_key + q_len:
        local_left = None  # reaches past every key: unbounded is the same mask
    if local_right is not None and local_right >= k_len - first_key:
        local_right = None
    return int(first_row), int(first_key), (None if local_left is None else int(local_left),
                                            None if local_right is None else int(local_right))


def _pairs(q_segs, k_segs, left, right):
    """Every (query piece, key piece, block window) whose block the mask keeps something of."""
    for qg, ql, qn in q_segs:
        for kg, kl, kn in k_segs:
            block = _block_window(qg, kg, qn, kn, left, right)
            if block is not None:
                yield (ql, qn), (kl, kn), block


# A selection of local rows (or keys): a range (start, stop), or the name of an index built once per
# call ("first": the first chunk of every document of a zigzag varlen shard, "second": the second).
Selection = Union[Tuple[int, int], str]


@dataclass(frozen=True)
class _Call:
    """One local attention call of a ring step: query rows ``rows`` against keys ``keys`` of the
    shard in hand, with ``kwargs`` (the mask, and the offsets of packed documents)."""
    rows: Selection
    keys: Selection
    kwargs: tuple  # (name, value) pairs

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)


def _in_global_order(segs) -> bool:
    """Whether local order is global order across the pieces (then a causal mask over the global
    positions is the causal mask over the local ones)."""
    return all(g0 + n0 <= g1 for (g0, _, n0), (g1, _, _) in zip(segs, segs[1:]))


def _adjacent(pieces) -> bool:
    return all(a0 + n0 == a1 for (a0, n0), (a1, _) in zip(pieces, pieces[1:]))


def _dense_calls(layout, rank, src, world, s, left, right) -> List[_Call]:
    """The local calls of this rank's queries against rank ``src``'s K/V shard: one call where the
    kept blocks allow it, else one per kept block."""
    q_segs, k_segs = segments(layout, rank, world, s), segments(layout, src, world, s)
    pairs = list(_pairs(q_segs, k_segs, left, right))
    if not pairs:
        return []
    if src == rank and left is None and right in (0, None) and _in_global_order(q_segs):
        # the diagonal shard: key j <= row i locally iff globally (both ascend), so one causal call
        return [_Call((0, s), (0, s), (("window_size", (None, right)),))]
    if all(block == (0, 0, (None, None)) for _, _, block in pairs):
        qs, ks = sorted({p for p, _, _ in pairs}), sorted({p for _, p, _ in pairs})
        if len(pairs) == len(qs) * len(ks) and _adjacent(qs) and _adjacent(ks):
            # every kept block unmasked, together a rectangle of local rows and keys: one call
            return [_Call((qs[0][0], sum(qs[-1])), (ks[0][0], sum(ks[-1])), (("window_size", (None, None)),))]
    return [_Call((q0 + first_row, q0 + qn), (k0 + first_key, k0 + kn), (("window_size", window),))
            for (q0, qn), (k0, kn), (first_row, first_key, window) in pairs]


class _Shards:
    """What this rank computes against each source shard, planned once per call: the local calls
    (``calls(src)``), the sequence dim of q/out (1 dense, 0 packed; the LSE's is the last), the
    index tensors named by selections, and the local function pair to call."""

    def __init__(self, rank: int, world: int, rows: int, varlen: bool, planner, index=None, backend="auto"):
        self.rank, self.world, self.rows, self.varlen, self.backend = rank, world, rows, varlen, backend
        self.dim = 0 if varlen else 1
        self.index: Dict[str, torch.Tensor] = index or {}
        self._planner = planner
        self._plans: Dict[int, List[_Call]] = {}

    def calls(self, src: int) -> List[_Call]:
        if src not in self._plans:
            self._plans[src] = self._planner(src)
        return self._plans[src]

    def take(self, x: torch.Tensor, sel: Selection, dim: int) -> torch.Tensor:
        if isinstance(sel, str):
            return x.index_select(dim, self.index[sel])
        return x.narrow(dim, sel[0], sel[1] - sel[0])

    def forward(self, q, k, v, call: _Call, softmax_scale):
        fn = api.attention_varlen if self.varlen else api.attention
        return fn(q, k, v, softmax_scale=softmax_scale, return_lse=True, backend=self.backend, **call.kw)

    def backward(self, dout, q, k, v, out, lse, call: _Call, softmax_scale):
        return api.attention_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, backend=self.backend,
                                      **call.kw)


def _dense_shards(layout, rank, world, s, left, right, backend="auto") -> _Shards:
    return _Shards(rank, world, s, False, lambda src: _dense_calls(layout, rank, src, world, s, left, right),
                   backend=backend)


def _varlen_shards(layout, rank, world, offsets: List[int], cu: torch.Tensor, causal: bool,
                   backend="auto") -> _Shards:
    """Packed documents, each cut like a whole sequence: every call is one varlen call over all
    documents. Causal zigzag, per source rank src: src == rank, causal over the whole shard;
    src < rank, every query row against the first chunk of every document, unmasked; src > rank,
    the second chunk of every document against all keys, unmasked. Contiguous causal: src < rank
    unmasked, src == rank causal, src > rank nothing. Not causal: unmasked."""
    t_local = offsets[-1] // world
    lens = [e - a for a, e in zip(offsets[:-1], offsets[1:])]
    longest = max(lens, default=0)
    cu_local = torch.div(cu, world, rounding_mode="floor")  # on the device: nothing read back
    whole = dict(cu_seqlens_q=cu_local, cu_seqlens_k=cu_local, max_seqlen_q=longest // world,
                 max_seqlen_k=longest // world)
    index = {}
    if causal and layout == "zigzag":
        cu_half = torch.div(cu, 2 * world, rounding_mode="floor").long()
        # token p of the first chunks (all documents', in order) is in document b with
        # cu_half[b] <= p < cu_half[b + 1]; its local row is p + cu_half[b] (document b starts at
        # cu_local[b] = 2 cu_half[b]), and the second chunk's row p + cu_half[b + 1]: built on the
        # device, nothing read back
        p = torch.arange(t_local // 2, dtype=torch.int64, device=cu.device)
        doc = torch.searchsorted(cu_half[1:], p, right=True)
        index = {"first": p + cu_half[doc], "second": p + cu_half[doc + 1]}
        cu_half = cu_half.int()
        half = longest // (2 * world)
        against_first = dict(whole, cu_seqlens_k=cu_half, max_seqlen_k=half)
        second_against_all = dict(whole, cu_seqlens_q=cu_half, max_seqlen_q=half)

    every = (0, t_local)

    def plan(src: int) -> List[_Call]:
        if t_local == 0:
            return []
        if not causal:
            return [_Call(every, every, tuple(dict(whole, causal=False).items()))]
        if src == rank:
            return [_Call(every, every, tuple(dict(whole, causal=True).items()))]
        if layout == "contiguous":
            return [_Call(every, every, tuple(dict(whole, causal=False).items()))] if src < rank else []
        if src < rank:
            return [_Call(every, "first", tuple(dict(against_first, causal=False).items()))]
        return [_Call("second", every, tuple(dict(second_against_all, causal=False).items()))]

    return _Shards(rank, world, t_local, True, plan, index, backend)
