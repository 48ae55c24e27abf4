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
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import api
from .layouts import (LAYOUTS, _check_document_lengths, _check_layout_name, _offsets_list, segments, shard,
                      shard_varlen, unshard, unshard_varlen)
from .plan import _dense_shards, _varlen_shards
from .ring import _METHODS, _ContextParallelAttention, _Ring

__all__ = ["context_parallel_attention", "context_parallel_attention_varlen", "shard", "unshard", "shard_varlen",
           "unshard_varlen", "segments", "LAYOUTS"]

_DTYPES = (torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------- checks


def _agree(group, what: str, problem: str, meta: dict, described: str) -> None:
    """Every rank's local problem (or "") and metadata (name -> value) to every rank; all raise the
    same error when any rank has a problem or the metadata differ, naming what differs and each
    rank's value of it. The ranks first compare a digest (one small all-gather); only when the
    digests differ is the whole metadata exchanged, for the message."""
    digest = hashlib.blake2b(repr([problem, list(meta.items())]).encode(), digest_size=7).digest()
    device = _group_device(group)
    mine = torch.tensor([int(bool(problem)), int.from_bytes(digest, "little")], dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    digests = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(digests, mine, group=group)
    rows = torch.stack(digests).tolist()  # the one sync of the check
    if all(r == rows[0] for r in rows) and not problem:
        return
    everyone = [None] * world
    dist.all_gather_object(everyone, [problem, meta], group=group)
    bad = [(r, m[0]) for r, m in enumerate(everyone) if m[0]]
    if bad:
        raise ValueError(f"{what}: " + "; ".join(f"rank {r}: {why}" for r, why in bad))
    metas = [m[1] for m in everyone]
    differing = [name for name in metas[0] if any(m.get(name) != metas[0][name] for m in metas)]
    differing += [name for m in metas for name in m if name not in metas[0] and name not in differing]
    if differing:
        diffs = [f"{name}: " + ", ".join(f"rank {r} {m.get(name)!r}" for r, m in enumerate(metas)) for name in differing]
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
        from ..masking import MaskSpec

        spec = MaskSpec.from_args(causal, window_size, "top_left", False)
        left, right = (spec.window_left, spec.window_right) if spec.kind.name == "WINDOW" else (None, None)
        if any(w is not None and w < 0 for w in (left, right)):
            raise ValueError(f"context parallelism takes window sides >= 0 or None, got {window_size!r}")
    except (TypeError, ValueError) as e:
        problem, left, right = f"{type(e).__name__}: {e}", None, None
    meta = dict(layout=layout, causal=bool(causal),
                window_size=tuple(window_size) if isinstance(window_size, (tuple, list)) else None,
                softmax_scale=softmax_scale, backend=backend)
    if not problem:
        meta.update(q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape), dtype=str(q.dtype))
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
        from ..masking import MaskSpec

        MaskSpec.from_args(causal, window_size, "top_left", False)
        offsets = _offsets_list(cu_seqlens)
        world = dist.get_world_size(group)
        _check_document_lengths(offsets, world, layout)
        if offsets[-1] != q.shape[0] * world:
            raise ValueError(f"cu_seqlens[-1] = {offsets[-1]} tokens, but {world} shards of {q.shape[0]} rows hold "
                             f"{q.shape[0] * world}")
    except (TypeError, ValueError) as e:
        problem = f"{type(e).__name__}: {e}"
    meta = dict(layout=layout, causal=bool(causal), softmax_scale=softmax_scale, backend=backend)
    if not problem:
        meta.update(q_shape=tuple(q.shape), k_shape=tuple(k.shape), v_shape=tuple(v.shape), dtype=str(q.dtype),
                    cu_seqlens=offsets)
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
