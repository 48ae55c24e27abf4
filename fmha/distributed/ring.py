"""Running the plan: the K/V shards passed around the ring (or all-gathered), each step's blocks
attended and merged exactly by their LSE, and the backward's gradients accumulated and passed
back to their owners; the autograd function over both."""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from .plan import Selection, _Shards


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
