"""Host side of decode over a KV cache: how a call is laid out for the kernels and put back.

* **GQA packing**: the ``g`` query heads that share a K/V head become ``g`` rows of one query
  tile (row ``s * g + j`` is query position s of head ``h_k * g + j``), so each K/V tile is read
  once per group instead of once per query head. ``pack_gqa``/``unpack_gqa`` move q, O and the
  LSE between the two layouts (copies of the query rows only: small in decode); with one query
  row the packed layout is a view (``packed_views``), and nothing is copied.
* **Split-KV** (flash-decoding): when the query tiles of a call cannot fill the GPU, each tile's
  keys are shared out over ``num_splits`` CTAs (``fmha.masking.split_share``), which write fp32
  partial outputs with their LSE; the combine pass (``kernels/common/split_combine.py``) merges
  them exactly and unpacks the rows. ``choose_num_splits`` picks the count.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

#: at most this many splits (the partials grow with it; beyond it the combine costs more than
#: the extra SMs give)
MAX_SPLITS = 64
#: a split should get at least this many K/V tiles: fewer cost more in start-up than they spread
MIN_TILES_PER_SPLIT = 2


def choose_num_splits(num_tiles: int, num_sms: int, kv_tiles: int) -> int:
    """Splits per query tile for ``num_tiles`` (query tile, head, batch) tiles of up to
    ``kv_tiles`` K/V tiles each on ``num_sms`` SMs: none when the tiles nearly fill the GPU, else
    the fewest whose waves come within 85% of the best wave efficiency (the rule
    FlashAttention's decode heuristic also follows)."""
    if num_tiles <= 0 or num_tiles >= 0.8 * num_sms:
        return 1
    limit = max(1, min(MAX_SPLITS, kv_tiles // MIN_TILES_PER_SPLIT, num_sms))
    efficiency = []
    for n in range(1, limit + 1):
        waves = num_tiles * n / num_sms
        efficiency.append(waves / math.ceil(waves))
    best = max(efficiency)
    return next(n for n, e in enumerate(efficiency, 1) if e >= 0.85 * best)


def pack_gqa(q: torch.Tensor, heads_k: int) -> torch.Tensor:
    """(B, S_q, H_q, D) -> (B, S_q * g, H_k, D), g = H_q / H_k: row s * g + j of K/V head h is
    query position s of query head h * g + j."""
    b, s, hq, d = q.shape
    g = hq // heads_k
    if s == 1:  # a view: one strided call (decode's common case)
        sb, _, sh, sd = q.stride()
        return q.as_strided((b, g, heads_k, d), (sb, sh, g * sh, sd))
    return q.view(b, s, heads_k, g, d).transpose(2, 3).reshape(b, s * g, heads_k, d)


def packed_views(out: torch.Tensor, lse: Optional[torch.Tensor], heads_k: int, seqlen_q: int):
    """``out`` (B, S_q, H_q, D) and ``lse`` (B, H_q, S_q) or None, viewed in the packed layout
    ((B, S_q * g, H_k, D) and (B, H_k, S_q * g), as ``pack_gqa`` and ``unpack_gqa`` lay them out),
    so that a kernel writes them in place; None where their memory does not allow it (more than
    one query row, unless H_k = 1; strides that do not merge)."""
    b, s, hq, d = out.shape
    g = hq // heads_k
    if s == 1:  # always views (one strided call each)
        sb, _, sh, sd = out.stride()
        o = out.as_strided((b, g, heads_k, d), (sb, sh, g * sh, sd))
        if lse is None:
            return o, None
        lb, lh, _ = lse.stride()
        return o, lse.as_strided((b, heads_k, g), (lb, g * lh, lh))
    try:
        o = out.view(b, s, heads_k, g, d).transpose(2, 3).view(b, s * g, heads_k, d)
        l_ = None if lse is None else lse.view(b, heads_k, g, s).transpose(2, 3).view(b, heads_k, s * g)
    except RuntimeError:  # not a view
        return None
    return o, l_


def unpack_gqa(o: torch.Tensor, lse: Optional[torch.Tensor], seqlen_q: int, out: torch.Tensor,
               lse_out: Optional[torch.Tensor]) -> None:
    """Write packed O (B, S_q * g, H_k, D) and LSE (B, H_k, S_q * g) into ``out`` (B, S_q, H_q, D)
    and ``lse_out`` (B, H_q, S_q)."""
    b, rows, hk, d = o.shape
    g = rows // max(seqlen_q, 1)
    _copy_split(out, (b, seqlen_q, hk, g, d), o.view(b, seqlen_q, g, hk, d).transpose(2, 3))
    if lse_out is not None:
        _copy_split(lse_out, (b, hk, g, seqlen_q), lse.view(b, hk, seqlen_q, g).transpose(2, 3))


def _copy_split(dst: torch.Tensor, shape: tuple, src: torch.Tensor) -> None:
    """``dst`` = ``src`` viewed as ``dst``'s shape, in one copy where ``dst`` can be viewed so."""
    if dst.is_contiguous():
        dst.view(shape).copy_(src)
    else:
        dst.copy_(src.reshape(dst.shape))
