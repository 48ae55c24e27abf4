"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

Each rank holds its shard of the sequence, (B, S_local, H, D) for q, k and v (or, packed,
(T_local, H, D) with the global document offsets). The ring form passes the K/V shards around the
ring (rank r sends to r + 1) while each rank attends its queries to the shard in hand, and merges
the partial results exactly by their LSE (docs/semantics.md, "Merging partial results"). Its
backward passes the K/V shards around again; the dK/dV accumulated for a shard travel one step
behind it (posted after a step's gradients are added, waited for only when the next step's
gradients are ready), and land back on the shard's owner after the last step. Local gradients
come from ``fmha.attention_backward`` with the merged output and LSE.

Layouts: ``"contiguous"`` (rank r holds positions r * S_local ..) or ``"zigzag"`` (the sequence cut
into 2 N chunks; rank r holds chunks r and 2 N - 1 - r), which gives every rank the same causal
work. ``shard`` and ``unshard`` convert a full tensor to and from a layout; ``shard_varlen`` and
``unshard_varlen`` do it for packed documents, each document cut like a whole sequence.

Masks are given as for the full sequence (``causal``, ``window_size``). Each ring step is planned
once (``_Shards.calls``): as ONE local call where the kept (query piece, key piece) blocks allow
it (the diagonal shard under a causal or no mask, whose pieces are in global order: one causal
call; blocks that are all unmasked and span contiguous local rows and keys: one unmasked call),
otherwise one call per kept block with the window shifted by the pieces' global offsets.
Communication is torch.distributed point-to-point (NCCL on GPUs, gloo on the CPU); the next
exchange is posted before the current shard is computed on, so the two overlap where the backend
runs them asynchronously. docs/distributed.md describes the scheme.

Every rank checks its inputs and the ranks compare their shapes, layout, mask (and document
offsets) before any exchange: a mismatch raises the same error on every rank instead of a hang.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from . import api

__all__ = ["context_parallel_attention", "context_parallel_attention_varlen", "shard", "unshard", "shard_varlen",
           "unshard_varlen", "segments", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")
_DTYPES = (torch.float16, torch.bfloat16)

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
        from .validation import _read_offsets

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


# ---------------------------------------------------------------------------- merging


def _merge(out_acc, lse_acc, out_blk, lse_blk) -> None:
    """Merge a block's (O, LSE) into the accumulators (fp32 views), in place:
    O = lerp(O, O_blk, w), w = exp(lse_blk - lse_new) = sigmoid(lse_blk - lse_acc): one pass over
    O after the block's cast to fp32. A row the block keeps nothing of (lse_blk = -inf) is left as
    it is; a row kept for the first time (lse_acc = -inf) becomes the block's exactly."""
    w = torch.where(torch.isneginf(lse_blk), 0.0, torch.sigmoid(lse_blk - lse_acc))
    lse_acc.copy_(torch.logaddexp(lse_acc, lse_blk))
    out_acc.lerp_(out_blk.float(), w.transpose(-1, -2).unsqueeze(-1))


class _Merged:
    """The output rows (fp32) and their LSE merged over blocks so far. A block whose rows nothing
    has reached yet is copied in, not merged; rows no block reaches end with O = 0, LSE = -inf.
    Blocks of an index selection merge into their own accumulator (its rows in index order),
    merged into these rows once, by ``result``."""

    def __init__(self, shards: _Shards, out_shape: tuple, lse_shape: tuple, device):
        self.shards, self.rows = shards, out_shape[shards.dim]
        self._out_shape, self._lse_shape, self._device = tuple(out_shape), tuple(lse_shape), device
        self.out = self.lse = None
        self._covered: List[Tuple[int, int]] = []
        self._subs: Dict[str, _Merged] = {}

    def add(self, sel: Selection, o: torch.Tensor, lse: torch.Tensor) -> None:
        if isinstance(sel, str):
            if sel not in self._subs:
                self._subs[sel] = _Merged(self.shards, o.shape, lse.shape, o.device)
            self._subs[sel].add((0, o.shape[self.shards.dim]), o, lse)
            return
        a, b = sel
        if self.out is None:
            self.out = torch.empty(self._out_shape, dtype=torch.float32, device=self._device)
            self.lse = torch.empty(self._lse_shape, dtype=torch.float32, device=self._device)
            if (a, b) != (0, self.rows):
                self.out.zero_()
                self.lse.fill_(-math.inf)
        out_acc = self.out.narrow(self.shards.dim, a, b - a)
        lse_acc = self.lse.narrow(-1, a, b - a)
        if all(b <= c0 or a >= c1 for c0, c1 in self._covered):
            out_acc.copy_(o)
            lse_acc.copy_(lse)
        else:
            _merge(out_acc, lse_acc, o, lse)
        self._covered.append((a, b))

    def result(self) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.out is None:
            self.out = torch.zeros(self._out_shape, dtype=torch.float32, device=self._device)
            self.lse = torch.full(self._lse_shape, -math.inf, dtype=torch.float32, device=self._device)
        dim = self.shards.dim
        for name, sub in self._subs.items():
            idx = self.shards.index[name]
            out_rows, lse_rows = self.out.index_select(dim, idx), self.lse.index_select(-1, idx)
            _merge(out_rows, lse_rows, sub.out, sub.lse)
            self.out.index_copy_(dim, idx, out_rows)
            self.lse.index_copy_(self.lse.dim() - 1, idx, lse_rows)
        return self.out, self.lse


class _GradRows:
    """fp32 gradient rows summed over blocks: the first block that covers every row is copied in;
    otherwise the rows are zeroed first (``ready=True``: ``buf`` already holds a sum to add to)."""

    def __init__(self, buf: torch.Tensor, shards: _Shards, ready: bool = False):
        self.buf, self.shards, self.ready = buf, shards, ready

    def add(self, sel: Selection, g: torch.Tensor) -> None:
        dim = self.shards.dim
        if isinstance(sel, str):
            self._zero_if_new()
            self.buf.index_add_(dim, self.shards.index[sel], g.float())
            return
        view = self.buf.narrow(dim, sel[0], sel[1] - sel[0])
        if not self.ready and sel == (0, self.buf.shape[dim]):
            view.copy_(g)
            self.ready = True
            return
        self._zero_if_new()
        view.add_(g)

    def _zero_if_new(self) -> None:
        if not self.ready:
            self.buf.zero_()
            self.ready = True

    def done(self) -> torch.Tensor:
        self._zero_if_new()
        return self.buf


# ---------------------------------------------------------------------------- one shard's blocks


class _RowCache:
    """This rank's query-side tensors (q, dout, out, lse) cut to the rows of a selection, made
    once per call: the same rows recur at many ring steps."""

    def __init__(self, shards: _Shards, **tensors):
        self.shards, self.tensors, self._cut = shards, tensors, {}

    def get(self, name: str, sel: Selection) -> torch.Tensor:
        key = (name, sel)
        if key not in self._cut:
            t = self.tensors[name]
            dim = t.dim() - 1 if name == "lse" else self.shards.dim
            cut = self.shards.take(t, sel, dim)
            self._cut[key] = cut if name == "q" else cut.contiguous()
        return self._cut[key]


def _attend_shard(shards: _Shards, src: int, rows: _RowCache, k_src, v_src, softmax_scale, acc: _Merged) -> None:
    """Merge the attention of this rank's queries to rank ``src``'s K/V shard into ``acc``."""
    for call in shards.calls(src):
        o, lse = shards.forward(rows.get("q", call.rows), shards.take(k_src, call.keys, shards.dim),
                                shards.take(v_src, call.keys, shards.dim), call, softmax_scale)
        acc.add(call.rows, o, lse)


def _grad_shard(shards: _Shards, src: int, rows: _RowCache, k_src, v_src, softmax_scale, dq: _GradRows) -> list:
    """Add the gradients of this rank's queries' attention to rank ``src``'s K/V shard into ``dq``
    (from the merged out and LSE); return that shard's (keys, dK block, dV block) to be added to
    its K/V gradients by the caller, when they are at hand."""
    blocks = []
    for call in shards.calls(src):
        sel = call.rows
        dq_b, dk_b, dv_b = shards.backward(
            rows.get("dout", sel), rows.get("q", sel), shards.take(k_src, call.keys, shards.dim),
            shards.take(v_src, call.keys, shards.dim), rows.get("out", sel), rows.get("lse", sel), call, softmax_scale)
        dq.add(sel, dq_b)
        blocks.append((call.keys, dk_b, dv_b))
    return blocks


def _add_kv_grads(shards: _Shards, dkv: torch.Tensor, like, blocks, ready: bool) -> None:
    """Add a shard's (keys, dK, dV) blocks into its flat fp32 dK/dV buffer."""
    dk, dv = (_GradRows(t, shards, ready) for t in _unpack(dkv, like))
    for keys, dk_b, dv_b in blocks:
        dk.add(keys, dk_b)
        dv.add(keys, dv_b)
    dk.done()
    dv.done()


# ---------------------------------------------------------------------------- the ring


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.backend = dist.get_backend(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world) if group is not None \
            else (self.rank + 1) % self.world
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world) if group is not None \
            else (self.rank - 1) % self.world

    def start(self, send: torch.Tensor) -> Tuple[torch.Tensor, list]:
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.group), dist.P2POp(dist.irecv, recv, self.prev, self.group)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works) -> None:
        for w in works:
            w.wait()

    def all_gather(self, mine: torch.Tensor) -> List[torch.Tensor]:
        if self.backend == "nccl":
            buf = torch.empty((self.world,) + tuple(mine.shape), dtype=mine.dtype, device=mine.device)
            dist.all_gather_into_tensor(buf, mine, group=self.group)
            return list(buf.unbind(0))
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(everyone, mine, group=self.group)
        return everyone

    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """Row r of the sum over ranks of ``rows`` (world, n), on rank r (an all-reduce on gloo,
        which has no reduce-scatter)."""
        if self.backend == "nccl":
            mine = torch.empty_like(rows[0])
            dist.reduce_scatter_tensor(mine, rows.reshape(-1), group=self.group)
            return mine
        dist.all_reduce(rows, group=self.group)
        return rows[self.rank]


def _pack(*tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: torch.Tensor, like) -> list:
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _accumulator(q, v, shards: _Shards) -> _Merged:
    """The merged output (q's rows, v's head dim) and LSE ((B, H, S) dense, (H, T) packed)."""
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_shape = (q.shape[1], q.shape[0]) if shards.varlen else (q.shape[0], q.shape[2], q.shape[1])
    return _Merged(shards, out_shape, lse_shape, q.device)


def _ring_forward(q, k, v, ring: _Ring, shards: _Shards, softmax_scale):
    acc = _accumulator(q, v, shards)
    rows = _RowCache(shards, q=q)
    kv = _pack(k, v)
    for step in range(ring.world):
        works = None
        if step + 1 < ring.world:
            nxt, works = ring.start(kv)
        src = (ring.rank - step) % ring.world
        k_src, v_src = _unpack(kv, (k, v))
        _attend_shard(shards, src, rows, k_src, v_src, softmax_scale, acc)
        if works is not None:
            _Ring.wait(works)
            kv = nxt
    out, lse = acc.result()
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, shards: _Shards, softmax_scale):
    """Each step: the K/V shard moves on while this rank computes its block gradients; then the
    dK/dV accumulated for the shard so far (sent by the previous rank one step earlier) are
    waited for, the blocks added, and the sum sent on without waiting, under the next step's
    compute. After the last step every shard's sum arrives at its owner."""
    dq = _GradRows(torch.empty(q.shape, dtype=torch.float32, device=q.device), shards)
    rows = _RowCache(shards, dout=dout, q=q, out=out, lse=lse)
    kv = _pack(k, v)
    n = k.numel() + v.numel()
    pending = None  # (the incoming dK/dV sum of the next shard, its works, the sum being sent)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        k_src, v_src = _unpack(kv, (k, v))
        works = None
        if step + 1 < ring.world:
            nxt_kv, works = ring.start(kv)
        blocks = _grad_shard(shards, src, rows, k_src, v_src, softmax_scale, dq)
        if pending is None:
            dkv, ready = torch.empty(n, dtype=torch.float32, device=q.device), False
        else:
            dkv, dkv_works, _sent = pending
            _Ring.wait(dkv_works)
            ready = True
        _add_kv_grads(shards, dkv, (k, v), blocks, ready)
        if ring.world > 1:
            recv, dkv_works = ring.start(dkv)  # on to the next rank, which adds its blocks a step later
            pending = (recv, dkv_works, dkv)
        else:
            pending = (dkv, [], dkv)
        if works is not None:
            _Ring.wait(works)
            kv = nxt_kv
    dkv, dkv_works, _sent = pending
    _Ring.wait(dkv_works)
    dk, dv = _unpack(dkv, (k, v))
    return dq.done().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gathered_forward(q, k, v, ring: _Ring, shards: _Shards, softmax_scale):
    """The all-gather form: every rank's K/V at once, then the same blocks as the ring's."""
    acc = _accumulator(q, v, shards)
    rows = _RowCache(shards, q=q)
    for src, kv in enumerate(ring.all_gather(_pack(k, v))):
        k_src, v_src = _unpack(kv, (k, v))
        _attend_shard(shards, src, rows, k_src, v_src, softmax_scale, acc)
    out, lse = acc.result()
    return out.to(q.dtype), lse


def _gathered_backward(dout, q, k, v, out, lse, ring: _Ring, shards: _Shards, softmax_scale):
    """dQ locally; every rank's K/V gradients summed over the ranks (a reduce-scatter; an
    all-reduce on gloo) and each rank keeps its own."""
    dq = _GradRows(torch.empty(q.shape, dtype=torch.float32, device=q.device), shards)
    rows = _RowCache(shards, dout=dout, q=q, out=out, lse=lse)
    dkv = torch.empty(ring.world, k.numel() + v.numel(), dtype=torch.float32, device=q.device)
    for src, kv in enumerate(ring.all_gather(_pack(k, v))):
        k_src, v_src = _unpack(kv, (k, v))
        blocks = _grad_shard(shards, src, rows, k_src, v_src, softmax_scale, dq)
        _add_kv_grads(shards, dkv[src], (k, v), blocks, False)
    dk, dv = _unpack(ring.reduce_scatter(dkv), (k, v))
    return dq.done().to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_METHODS = {"ring": (_ring_forward, _ring_backward), "all_gather": (_gathered_forward, _gathered_backward)}


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, shards, softmax_scale, method):
        with torch.no_grad():
            out, lse = _METHODS[method][0](q, k, v, ring, shards, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, shards, softmax_scale)
        ctx.method = method
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _METHODS[ctx.method][1](dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------- checks


def _agree(group, what: str, problem: str, meta: list, described: str) -> None:
    """Every rank's local problem (or "") and metadata to every rank; all raise the same error
    when any rank has a problem or the metadata differ. The ranks first compare a digest (one small
    all-gather); only when the digests differ is the whole metadata exchanged, for the message."""
    digest = hashlib.blake2b(repr([problem] + meta).encode(), digest_size=7).digest()
    device = _group_device(group)
    mine = torch.tensor([int(bool(problem)), int.from_bytes(digest, "little")], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    digests = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(digests, mine, group=group)
    rows = torch.stack(digests).tolist()  # the one sync of the check
    if all(r == rows[0] for r in rows) and not problem:
        return
    everyone = [None] * world
    dist.all_gather_object(everyone, [problem] + meta, group=group)
    bad = [(r, m[0]) for r, m in enumerate(everyone) if m[0]]
    if bad:
        raise ValueError(f"{what}: " + "; ".join(f"rank {r}: {why}" for r, why in bad))
    if any(m != everyone[0] for m in everyone):
        diffs = [f"rank {r}: {m[1:]}" for r, m in enumerate(everyone)]
        raise ValueError(f"{what}: the ranks' {described} differ (every rank must pass shards of one sequence "
                         "in one layout with the same mask): " + "; ".join(diffs))
    # equal metadata written differently (a scale 1 and 1.0): nothing to refuse


def _check_devices(group, tensors) -> None:
    expected = _group_device(group)
    for name, t in tensors:
        if t.device.type != expected.type:
            raise ValueError(f"{name} is on {t.device}, but the group's backend "
                             f"({dist.get_backend(group)}) works on {expected.type} tensors")


def _check_method(method) -> None:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {tuple(_METHODS)}, got {method!r}")


def _check_shards(q, k, v, group, layout, causal, window_size, softmax_scale,
                  backend="auto") -> Tuple[Optional[int], Optional[int]]:
    """The mask's (left, right). Local problems become an error code that every rank sees in the
    exchange of metadata, so all ranks raise together."""
    problem = ""
    try:
        _check_layout_name(layout)
        api.check_backend_name(backend)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-D (B, S_local, H, D) tensor")
            if t.dtype not in _DTYPES:
                raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if k.shape[:3] != v.shape[:3] or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be shards of one "
                             "self-attention sequence: the same batch and local length, q and k the same head dim")
        if layout == "zigzag" and q.shape[1] % 2:
            raise ValueError(f"a zigzag shard holds two equal chunks: its length ({q.shape[1]}) must be even")
        _check_devices(group, (("q", q), ("k", k), ("v", v)))
        from .masking import MaskSpec

        spec = MaskSpec.from_args(causal, window_size, "top_left", False)
        left, right = (spec.window_left, spec.window_right) if spec.kind.name == "WINDOW" else (None, None)
        if any(w is not None and w < 0 for w in (left, right)):
            raise ValueError(f"context parallelism takes window sides >= 0 or None, got {window_size!r}")
    except (TypeError, ValueError) as e:
        problem, left, right = f"{type(e).__name__}: {e}", None, None
    meta = [layout, bool(causal), tuple(window_size) if isinstance(window_size, (tuple, list)) else None,
            softmax_scale, backend] + ([tuple(t.shape) for t in (q, k, v)] + [str(q.dtype)] if not problem else [])
    _agree(group, "context_parallel_attention", problem, meta, "shards, layouts or masks")
    return left, right


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def context_parallel_attention(q, k, v, *, group=None, causal=False, window_size=(None, None),
                               layout="zigzag", softmax_scale=None, return_lse=False, method="ring", backend="auto"):
    """Attention over a sequence sharded across ``group`` (default: the world): each rank passes
    its shard (B, S_local, H, D) of q, k and v in ``layout`` and gets the output rows of its
    shard (and their LSE (B, H_q, S_local) with ``return_lse``). ``causal``/``window_size`` are
    those of the full sequence. Differentiable in q, k and v. ``method``: ``"ring"`` passes the
    K/V shards around; ``"all_gather"`` gathers every shard at once (for short K/V, e.g. GQA with
    few K/V heads), its backward sums the K/V gradients with one reduce-scatter. ``backend`` is
    passed to every local call (``"kernel"``: raise rather than fall back to the reference)."""
    _check_method(method)
    left, right = _check_shards(q, k, v, group, layout, causal, window_size, softmax_scale, backend)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(group)
    shards = _dense_shards(layout, ring.rank, ring.world, q.shape[1], left, right, backend)
    out, lse = _ContextParallelAttention.apply(q, k, v, ring, shards, float(softmax_scale), method)
    return (out, lse) if return_lse else out


def _check_varlen_shards(q, k, v, cu_seqlens, group, layout, causal, window_size, softmax_scale,
                         backend="auto") -> List[int]:
    """The global offsets, read on the host (one sync per call). As ``_check_shards``, and the
    ranks' offsets must be equal."""
    problem, offsets = "", None
    try:
        _check_layout_name(layout)
        api.check_backend_name(backend)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be a 3-D (T_local, H, D) tensor of packed documents")
            if t.dtype not in _DTYPES:
                raise TypeError(f"{name} must be float16 or bfloat16, got {t.dtype}")
        if k.shape[:2] != v.shape[:2] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be shards of one "
                             "self-attention sequence: the same local length, q and k the same head dim")
        _check_devices(group, (("q", q), ("k", k), ("v", v)))
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32:
            raise TypeError("cu_seqlens must be a 1-D int32 tensor of the global document offsets")
        if cu_seqlens.device != q.device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device}, q on {q.device}: put them on one device")
        if isinstance(window_size, (tuple, list)) and len(window_size) == 2 and any(w is not None for w in window_size):
            raise ValueError(f"window_size={tuple(window_size)}: sliding windows are not supported with packed "
                             "documents across shards (a document's window offsets differ per document, so a "
                             "step is no longer one local call); use context_parallel_attention per sequence")
        from .masking import MaskSpec

        MaskSpec.from_args(causal, window_size, "top_left", False)
        offsets = _offsets_list(cu_seqlens)
        world = dist.get_world_size(group)
        _check_document_lengths(offsets, world, layout)
        if offsets[-1] != q.shape[0] * world:
            raise ValueError(f"cu_seqlens[-1] = {offsets[-1]} tokens, but {world} shards of {q.shape[0]} rows hold "
                             f"{q.shape[0] * world}")
    except (TypeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    meta = [layout, bool(causal), softmax_scale, backend] + (
        [tuple(t.shape) for t in (q, k, v)] + [str(q.dtype), offsets] if not problem else [])
    _agree(group, "context_parallel_attention_varlen", problem, meta, "shards, layouts, masks or cu_seqlens")
    return offsets


def context_parallel_attention_varlen(q, k, v, cu_seqlens, *, group=None, causal=False, window_size=(None, None),
                                      layout="zigzag", softmax_scale=None, return_lse=False, method="ring",
                                      backend="auto"):
    """Attention over packed documents sharded across ``group``: ``cu_seqlens`` are the GLOBAL
    document offsets (int32, on q's device, the same on every rank), each document cut like a
    whole sequence (``shard_varlen``), so each rank's shard (T_local, H, D) is the concatenation
    of its chunks of every document and its local offsets are ``cu_seqlens // world``. Returns
    the output rows of the shard (and their LSE (H_q, T_local) with ``return_lse``).
    ``causal`` applies per document; sliding windows are refused. ``cu_seqlens`` is read on the
    host once per call (the check that every rank has the same); the local calls are given their
    max lengths, so they read nothing back. Differentiable in q, k and v; ``method`` as for
    :func:`context_parallel_attention`, and ``backend``."""
    _check_method(method)
    offsets = _check_varlen_shards(q, k, v, cu_seqlens, group, layout, causal, window_size, softmax_scale, backend)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    ring = _Ring(group)
    shards = _varlen_shards(layout, ring.rank, ring.world, offsets, cu_seqlens, bool(causal), backend)
    out, lse = _ContextParallelAttention.apply(q, k, v, ring, shards, float(softmax_scale), method)
    return (out, lse) if return_lse else out
