"""Attention over a KV cache, dense or paged (serving: decode and chunked prefill).

``attention_with_kvcache`` takes the new query rows of each sequence and its cache: dense
(B, S_max, H_k, D), or paged (num_pages, page_size, H_k, D) with a ``block_table`` (B, max_pages)
that maps sequence b's logical key position p to page ``block_table[b, p // page_size]``, row
``p % page_size`` (docs/semantics.md, "KV cache"). The query rows are the last of each sequence:
masks are bottom-right aligned. Optional ``k_new``/``v_new`` are first written into the cache at
``cache_seqlens[b]`` and attended to as well (``cache_seqlens`` itself is not changed, as in
FlashAttention's ``flash_attn_with_kvcache``).

No kernel serves this entry point yet: every call runs the exact reference, which reads
``cache_seqlens`` and the block table on the host (a sync) and checks them there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .masking import MaskSpec
from .problem import INPUT_DTYPES, default_out_dtype, output_dtypes_for
from .validation import _check_layout, _dtype_name, _require_tensor, _scale

#: page sizes a paged cache may have (the kernels' TMA boxes are 16-row multiples)
PAGE_SIZES = tuple(range(16, 257, 16))


def _check_index_tensor(name: str, t, dim: int, device: torch.device) -> None:
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_dtype_name(t.dtype)}; use .to(torch.int32)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with .to(q.device)")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")


def validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out_dtype):
    """Checks that need no values; returns (paged, page_size, capacity, out_dtype)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, t)
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; use one of "
                            f"{', '.join(_dtype_name(d) for d in INPUT_DTYPES)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        _check_layout(name, t)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache and v_cache must share a dtype, got {_dtype_name(q.dtype)}, "
                        f"{_dtype_name(k_cache.dtype)}, {_dtype_name(v_cache.dtype)}")
    batch, _, heads_q, head_dim = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                         f"their first three dims, and k_cache's head dim must be q's ({head_dim})")
    heads_k = k_cache.shape[2]
    if heads_k == 0 or heads_q % heads_k:
        raise ValueError(f"the query heads ({heads_q}) must be a multiple of the cache's K/V heads ({heads_k})")
    _check_index_tensor("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for a batch of {batch}")
    paged = block_table is not None
    if paged:
        _check_index_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
        page_size = k_cache.shape[1]
        if page_size not in PAGE_SIZES:
            raise ValueError(f"the page size (k_cache.shape[1]) must be a multiple of 16 from 16 to 256, "
                             f"got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a dense cache has one row per sequence: k_cache.shape[0] = {k_cache.shape[0]}, "
                             f"batch {batch} (pass block_table= for a paged cache)")
        page_size, capacity = None, k_cache.shape[1]
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if k_new is not None:
        for name, t, like in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
            _require_tensor(name, t)
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != like.shape[2:] or t.dtype != like.dtype:
                raise ValueError(f"{name} must be (B, S_new, H_k, D) = ({batch}, S_new, {like.shape[2]}, "
                                 f"{like.shape[3]}) in {_dtype_name(like.dtype)}, got {tuple(t.shape)} "
                                 f"{_dtype_name(t.dtype)}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if k_new.shape[1] != v_new.shape[1]:
            raise ValueError(f"k_new and v_new have {k_new.shape[1]} and {v_new.shape[1]} rows")
    if out_dtype is None:
        out_dtype = default_out_dtype(q.dtype)
    if out_dtype not in output_dtypes_for(q.dtype):
        raise TypeError(f"unsupported out_dtype {_dtype_name(out_dtype)} for {_dtype_name(q.dtype)} input")
    return paged, page_size, capacity, out_dtype


def _key_positions(b: int, length: int, block_table, page_size: Optional[int], num_pages: int,
                   device: torch.device):
    """(page or batch row, row within it) of sequence b's logical keys 0 .. length - 1."""
    pos = torch.arange(length, device=device)
    if block_table is None:
        return torch.full_like(pos, b), pos
    pages = block_table[b, pos // page_size].long()
    bad = (pages < 0) | (pages >= num_pages)
    if bad.any():
        at = int(pos[bad][0])
        raise ValueError(f"block_table[{b}, {at // page_size}] = {int(block_table[b, at // page_size])} is not a "
                         f"page of the cache (0 .. {num_pages - 1})")
    return pages, pos % page_size


def attention_with_kvcache(
    q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None,
    causal=True, window_size=(None, None), softmax_scale=None, scale_q=1.0, scale_k=1.0, scale_v=1.0,
    inv_scale_o=1.0, return_lse=False, out_dtype=None, backend="auto",
):
    """Attention of the new query rows q (B, S_q, H_q, D) over each sequence's cached keys (and
    ``k_new``/``v_new``, appended to the cache first). ``cache_seqlens`` (B,) int32: valid
    cached keys per sequence. Dense cache (B, S_max, H_k, D); paged (num_pages, page_size, H_k,
    D) with ``block_table`` (B, max_pages) int32. Masks are bottom-right aligned: with ``causal``
    (the default) row i of S_q sees keys up to L - S_q + i, L the sequence's length including
    the new keys. Returns O (B, S_q, H_q, D_v), or (O, LSE (B, H_q, S_q)) with ``return_lse``."""
    from .backends import check_backend_name
    from .reference import attention_reference, cast_output

    check_backend_name(backend)
    paged, page_size, capacity, out_dtype = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                                             k_new, v_new, out_dtype)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    mask = MaskSpec.from_args(causal, window_size, "bottom_right", False)
    scales = dict(softmax_scale=_scale("softmax_scale", softmax_scale, allow_none=True),
                  scale_q=_scale("scale_q", scale_q), scale_k=_scale("scale_k", scale_k),
                  scale_v=_scale("scale_v", scale_v), inv_scale_o=_scale("inv_scale_o", inv_scale_o))
    if backend == "kernel":
        from .backends import UnsupportedError

        raise UnsupportedError(["attention_with_kvcache: no kernel serves a KV cache yet; the reference runs it"])
    batch, s_q, heads_q, _ = q.shape
    s_new = 0 if k_new is None else k_new.shape[1]
    lengths = cache_seqlens.tolist()  # host read: the reference walks each sequence
    for b, n in enumerate(lengths):
        if n < 0 or n + s_new > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n}" + (f" plus {s_new} new keys" if s_new else "")
                             + f" does not fit the cache's {capacity} positions per sequence"
                             + (" (block_table columns x page size)" if paged else ""))
    num_pages = k_cache.shape[0]
    # every sequence's key positions are checked before the cache is written
    positions = [_key_positions(b, n + s_new, block_table, page_size, num_pages, q.device)
                 for b, n in enumerate(lengths)]
    if s_new:
        for b, (n, (rows, cols)) in enumerate(zip(lengths, positions)):
            k_cache[rows[n:], cols[n:]] = k_new[b]
            v_cache[rows[n:], cols[n:]] = v_new[b]
    out = torch.empty(q.shape[:-1] + (v_cache.shape[-1],), dtype=out_dtype, device=q.device)
    lse = torch.full((batch, heads_q, s_q), -math.inf, dtype=torch.float32, device=q.device)
    for b, (rows, cols) in enumerate(positions):
        k, v = k_cache[rows, cols], v_cache[rows, cols]  # (L, H_k, D)
        o_b, lse_b = attention_reference(q[b:b + 1], k[None], v[None], mask=mask, **scales)
        out[b] = cast_output(o_b[0], out_dtype)
        lse[b] = lse_b[0]
    return (out, lse) if return_lse else out
