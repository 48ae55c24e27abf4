"""Context parallelism: attention over a sequence sharded across the ranks of a process group.

Each rank holds its shard of the sequence, (B, S_local, H, D) for q, k and v. The ring form
passes the K/V shards around the ring (rank r sends to r + 1) while each rank attends its
queries to the shard in hand, and merges the partial results exactly by their LSE
(docs/semantics.md, "Merging partial results"). Its backward passes the K/V shards around again,
each with the dK/dV accumulated for it so far, which lands back on its owner after the last step;
the local gradients come from ``fmha.attention_backward`` with the merged output and LSE.

Layouts: ``"contiguous"`` (rank r holds positions r * S_local ..) or ``"zigzag"`` (the sequence cut
into 2 N chunks; rank r holds chunks r and 2 N - 1 - r), which gives every rank the same causal
work. ``shard`` and ``unshard`` convert a full tensor to and from a layout.

Masks are given as for the full sequence (``causal``, ``window_size``); each (query chunk, key
chunk) pair becomes a local call with the window shifted by the chunks' global offsets, or is
skipped when the mask keeps nothing of it. Communication is torch.distributed point-to-point
(NCCL on GPUs, gloo on the CPU); the next exchange is posted before the current shard is
computed on, so the two overlap where the backend runs them asynchronously.

Every rank checks its inputs and the ranks compare their shapes, layout and mask before any
exchange: a mismatch raises the same error on every rank instead of a hang.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from . import api

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


def _merge(out_acc, lse_acc, out_blk, lse_blk):
    """Merge a block's (O, LSE) into the accumulators (fp32, rows of one piece), in place."""
    new = torch.logaddexp(lse_acc, lse_blk)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_acc = torch.exp(lse_acc - safe).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_blk = torch.exp(lse_blk - safe).transpose(1, 2).unsqueeze(-1)
    out_acc.mul_(w_acc).add_(out_blk.float() * w_blk)
    lse_acc.copy_(new)


def _attend_shard(q, k_src, v_src, q_segs, k_segs, left, right, softmax_scale, out, lse) -> None:
    """Merge the attention of this rank's queries to one K/V shard into ``out``/``lse`` (fp32)."""
    for (q0, qn), (k0, kn), (first_row, first_key, window) in _pairs(q_segs, k_segs, left, right):
        rows = slice(q0 + first_row, q0 + qn)
        keys = slice(k0 + first_key, k0 + kn)
        o_blk, l_blk = api.attention(q[:, rows], k_src[:, keys], v_src[:, keys], window_size=window,
                                     softmax_scale=softmax_scale, return_lse=True)
        _merge(out[:, rows], lse[:, :, rows], o_blk, l_blk)  # views: merged in place


def _grad_shard(dout, q, k_src, v_src, out, lse, q_segs, k_segs, left, right, softmax_scale, dq, dk_src,
                dv_src) -> None:
    """Add the gradients of this rank's queries' attention to one K/V shard into ``dq`` and that
    shard's ``dk_src``/``dv_src`` (fp32), from the merged ``out`` and ``lse``."""
    for (q0, qn), (k0, kn), (first_row, first_key, window) in _pairs(q_segs, k_segs, left, right):
        rows = slice(q0 + first_row, q0 + qn)
        keys = slice(k0 + first_key, k0 + kn)
        dq_b, dk_b, dv_b = api.attention_backward(
            dout[:, rows].contiguous(), q[:, rows], k_src[:, keys], v_src[:, keys], out[:, rows].contiguous(),
            lse[:, :, rows].contiguous(), window_size=window, softmax_scale=softmax_scale)
        dq[:, rows] += dq_b.float()
        dk_src[:, keys] += dk_b.float()
        dv_src[:, keys] += dv_b.float()


# ---------------------------------------------------------------------------- the ring


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
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


def _pack(*tensors) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _unpack(buf: torch.Tensor, like) -> list:
    out, at = [], 0
    for t in like:
        out.append(buf[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _ring_forward(q, k, v, ring: _Ring, layout, left, right, softmax_scale):
    b, s, hq, _ = q.shape
    out = torch.zeros(b, s, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, s), -math.inf, dtype=torch.float32, device=q.device)
    q_segs = segments(layout, ring.rank, ring.world, s)
    kv = _pack(k, v)
    for step in range(ring.world):
        works = None
        if step + 1 < ring.world:
            nxt, works = ring.start(kv)
        src = (ring.rank - step) % ring.world
        k_src, v_src = _unpack(kv, (k, v))
        _attend_shard(q, k_src, v_src, q_segs, segments(layout, src, ring.world, s), left, right, softmax_scale,
                      out, lse)
        if works is not None:
            _Ring.wait(works)
            kv = nxt
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, ring: _Ring, layout, left, right, softmax_scale):
    s = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    q_segs = segments(layout, ring.rank, ring.world, s)
    kv = _pack(k, v)
    dkv = torch.zeros(k.numel() + v.numel(), dtype=torch.float32, device=q.device)
    for step in range(ring.world):
        src = (ring.rank - step) % ring.world
        k_src, v_src = _unpack(kv, (k, v))
        dk_src, dv_src = _unpack(dkv, (k, v))
        works = None
        if step + 1 < ring.world:  # the K/V shard moves on while this rank computes on it
            nxt_kv, works = ring.start(kv)
        _grad_shard(dout, q, k_src, v_src, out, lse, q_segs, segments(layout, src, ring.world, s), left, right,
                    softmax_scale, dq, dk_src, dv_src)
        if works is not None:
            _Ring.wait(works)
            kv = nxt_kv
        # the gradients of the shard in hand follow it; after the last step they go home
        dkv, dkv_works = ring.start(dkv)
        _Ring.wait(dkv_works)
    dk, dv = _unpack(dkv, (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _gathered_forward(q, k, v, ring: _Ring, layout, left, right, softmax_scale):
    """The all-gather form: every rank's K/V at once, then the same blocks as the ring's."""
    b, s, hq, _ = q.shape
    out = torch.zeros(b, s, hq, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, hq, s), -math.inf, dtype=torch.float32, device=q.device)
    everyone = [torch.empty_like(_pack(k, v)) for _ in range(ring.world)]
    dist.all_gather(everyone, _pack(k, v), group=ring.group)
    q_segs = segments(layout, ring.rank, ring.world, s)
    for src, kv in enumerate(everyone):
        k_src, v_src = _unpack(kv, (k, v))
        _attend_shard(q, k_src, v_src, q_segs, segments(layout, src, ring.world, s), left, right, softmax_scale,
                      out, lse)
    return out.to(q.dtype), lse


def _gathered_backward(dout, q, k, v, out, lse, ring: _Ring, layout, left, right, softmax_scale):
    """dQ locally; every rank's K/V gradients summed over the ranks (an all-reduce: gloo has no
    reduce-scatter) and each rank keeps its own."""
    s = q.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    everyone = [torch.empty_like(_pack(k, v)) for _ in range(ring.world)]
    dist.all_gather(everyone, _pack(k, v), group=ring.group)
    dkv = torch.zeros(ring.world, k.numel() + v.numel(), dtype=torch.float32, device=q.device)
    q_segs = segments(layout, ring.rank, ring.world, s)
    for src, kv in enumerate(everyone):
        k_src, v_src = _unpack(kv, (k, v))
        dk_src, dv_src = _unpack(dkv[src], (k, v))
        _grad_shard(dout, q, k_src, v_src, out, lse, q_segs, segments(layout, src, ring.world, s), left, right,
                    softmax_scale, dq, dk_src, dv_src)
    dist.all_reduce(dkv, group=ring.group)
    dk, dv = _unpack(dkv[ring.rank], (k, v))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_METHODS = {"ring": (_ring_forward, _ring_backward), "all_gather": (_gathered_forward, _gathered_backward)}


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, layout, left, right, softmax_scale, method):
        with torch.no_grad():
            out, lse = _METHODS[method][0](q, k, v, ring, layout, left, right, softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, layout, left, right, softmax_scale)
        ctx.method = method
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            dq, dk, dv = _METHODS[ctx.method][1](dout.contiguous(), q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None, None, None, None, None


# ---------------------------------------------------------------------------- checks


def _check_shards(q, k, v, group, layout, causal, window_size, softmax_scale) -> Tuple[Optional[int], Optional[int]]:
    """The mask's (left, right). Local problems become an error code that every rank sees in the
    exchange of metadata, so all ranks raise together."""
    problem = ""
    try:
        _check_layout_name(layout)
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
        expected = _group_device(group)
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.device.type != expected.type:
                raise ValueError(f"{name} is on {t.device}, but the group's backend "
                                 f"({dist.get_backend(group)}) works on {expected.type} tensors")
        from .masking import MaskSpec

        spec = MaskSpec.from_args(causal, window_size, "top_left", False)
        left, right = (spec.window_left, spec.window_right) if spec.kind.name == "WINDOW" else (None, None)
    except (TypeError, ValueError) as e:
        problem, left, right = f"{type(e).__name__}: {e}", None, None
    world = dist.get_world_size(group)
    mine = [problem, layout, bool(causal), tuple(window_size) if isinstance(window_size, (tuple, list)) else None,
            softmax_scale] + ([tuple(t.shape) for t in (q, k, v)] + [str(q.dtype)] if not problem else [])
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    bad = [(r, m[0]) for r, m in enumerate(everyone) if m[0]]
    if bad:
        raise ValueError("context_parallel_attention: " + "; ".join(f"rank {r}: {why}" for r, why in bad))
    if any(m != everyone[0] for m in everyone):
        diffs = [f"rank {r}: {m[1:]}" for r, m in enumerate(everyone)]
        raise ValueError("context_parallel_attention: the ranks' shards, layouts or masks differ (every rank must "
                         "pass shards of one sequence in one layout with the same mask): " + "; ".join(diffs))
    return left, right


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def context_parallel_attention(q, k, v, *, group=None, causal=False, window_size=(None, None),
                               layout="zigzag", softmax_scale=None, return_lse=False, method="ring"):
    """Attention over a sequence sharded across ``group`` (default: the world): each rank passes
    its shard (B, S_local, H, D) of q, k and v in ``layout`` and gets the output rows of its
    shard (and their LSE (B, H_q, S_local) with ``return_lse``). ``causal``/``window_size`` are
    those of the full sequence. Differentiable in q, k and v. ``method``: ``"ring"`` passes the
    K/V shards around; ``"all_gather"`` gathers every shard at once (for short K/V, e.g. GQA with
    few K/V heads), its backward sums the K/V gradients with one all-reduce."""
    if method not in _METHODS:
        raise ValueError(f"method must be one of {tuple(_METHODS)}, got {method!r}")
    left, right = _check_shards(q, k, v, group, layout, causal, window_size, softmax_scale)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = _ContextParallelAttention.apply(q, k, v, _Ring(group), layout, left, right, float(softmax_scale), method)
    return (out, lse) if return_lse else out
