"""``flash_attn_func``, ``flash_attn_varlen_func`` (FlashAttention-4's ``flash_attn.cute``
signatures, 4.0.0b36) and ``flash_attn_with_kvcache`` (FlashAttention-3's signature; FA4 has
none), computed by fmha.

Each call is checked, FlashAttention's conventions are mapped onto fmha's
(``conventions``), and the call goes to the fmha entry point that computes it exactly:
``fmha.attention`` for dense batches, ``fmha.attention_varlen`` for packed ones,
``fmha.attention_with_kvcache`` for dense or packed queries over a dense or paged cache, and,
for the layouts fmha has no entry point for (``seqused_q``, page sizes fmha's paged cache does
not take, anything requiring grad over a cache), ``fmha.attention_varlen`` on the rows gathered
into a packed batch (``packing``). FlashAttention features fmha does not have raise
``NotImplementedError`` naming the argument.
"""

from __future__ import annotations

import operator
import re

import torch

import fmha
from fmha.kvcache import PAGE_SIZES
from fmha.validation import check_index_tensor, kernel_layout

from . import packing
from .conventions import (check_learnable_sink, lse_for_caller, needs_grad, refuse_unsupported, wants_lse,
                          window_fa3, window_fa4)

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _refuse_fa4_features(qv, gather_kv_indices, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
                         block_sparse_tensors, block_sparse_tensors_bwd=None):
    refuse_unsupported((
        ("qv", qv is not None, "MLA's absorbed query against V"),
        ("gather_kv_indices", gather_kv_indices is not None, "sparse top-k key selection"),
        ("score_mod", score_mod is not None, "a custom score modification"),
        ("score_mod_bwd", score_mod_bwd is not None, "the backward of a custom score modification"),
        ("mask_mod", mask_mod is not None, "a custom mask function"),
        ("aux_tensors", aux_tensors is not None, "inputs of score_mod/mask_mod"),
        ("aux_scalars", aux_scalars is not None, "inputs of score_mod/mask_mod"),
        ("block_sparse_tensors", block_sparse_tensors is not None, "block-sparse attention"),
        ("block_sparse_tensors_bwd", block_sparse_tensors_bwd is not None, "block-sparse attention's backward"),
    ))


def _check_gather_backward_options(gather_bwd_recompute_p, gather_bwd_token_chunk):
    # FlashAttention raises too: without gather_kv_indices these would be silently ignored
    if gather_bwd_recompute_p or gather_bwd_token_chunk is not None:
        raise ValueError("gather_bwd_recompute_p / gather_bwd_token_chunk only apply to sparse top-k MLA "
                         "attention (gather_kv_indices), which fmha does not have; leave them at their defaults")


def _require_tensors(**tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _host_int(x):
    """A max_seqlen hint as an int, or None (tensor hints are not read: that would sync)."""
    if x is None or isinstance(x, (bool, torch.Tensor)):
        return None
    try:
        return operator.index(x)
    except TypeError:
        raise TypeError(f"max_seqlen_q/max_seqlen_k must be ints or None, got {type(x).__name__}") from None


def _softcap(softcap) -> float:
    return 0.0 if softcap is None else softcap  # FlashAttention treats None like 0: no cap


def _splits_hint(num_splits):
    """FlashAttention's num_splits as fmha's decode hint: above 1 a request, else fmha chooses."""
    if isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits > 1:
        return num_splits
    return None


def _fa4_result(result, want_lse: bool, return_lse: bool):
    """An fmha result (O, or (O, LSE) when ``want_lse``) as FlashAttention-4's pair."""
    out, lse = result if want_lse else (result, None)
    return out, lse_for_caller(lse, return_lse)


def flash_attn_func(
    q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, window_size=(None, None),
    learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, score_mod=None,
    score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
    block_sparse_tensors_bwd=None, return_lse=False, gather_bwd_recompute_p=False, gather_bwd_token_chunk=None,
):
    """Attention of q (B, S_q, H_q, D) over k, v (B, S_k, H_k, D[_v]), as FlashAttention-4's
    ``flash_attn_func``: returns ``(out, lse)``, lse (B, H_q, S_q) fp32 (natural log) when
    ``return_lse`` or an input requires grad, else None. Masks are bottom-right aligned;
    ``window_size`` sides are ints (negative: a band offset) or None (unbounded), ``(-1, -1)``
    and any pair of negatives meaning no window; ``causal`` sets the right side to 0.
    ``learnable_sink`` is fmha's ``sinks``. ``num_splits`` and ``pack_gqa`` are accepted and left
    to fmha. Differentiable in q, k, v and ``learnable_sink``."""
    _refuse_fa4_features(qv, gather_kv_indices, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
                         block_sparse_tensors, block_sparse_tensors_bwd)
    _check_gather_backward_options(gather_bwd_recompute_p, gather_bwd_token_chunk)
    _require_tensors(q=q, k=k, v=v)
    q, k, v, learnable_sink = (kernel_layout(t) for t in (q, k, v, learnable_sink))
    check_learnable_sink(learnable_sink, q.shape[-2])
    want_lse = wants_lse(return_lse, q, k, v, learnable_sink)
    result = fmha.attention(
        q, k, v, window_size=window_fa4(causal, window_size), mask_align="bottom_right",
        softmax_scale=softmax_scale, softcap=_softcap(softcap), sinks=learnable_sink, return_lse=want_lse,
        deterministic=bool(deterministic))
    return _fa4_result(result, want_lse, return_lse)


def _check_varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table) -> int:
    """Shapes and index tensors of a varlen call; returns the batch size."""
    device = q.device
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q),
                    ("seqused_k", seqused_k)):
        if t is not None:
            check_index_tensor(name, t, 1, device)
    if cu_seqlens_q is not None:
        if q.dim() != 3:
            raise ValueError(f"with cu_seqlens_q, q must be packed (total_q, H, D), got shape {tuple(q.shape)}")
        batch = cu_seqlens_q.numel() - 1
        if batch < 0:
            raise ValueError("cu_seqlens_q must have B + 1 entries, got none")
    else:
        if q.dim() != 4:
            raise ValueError(f"without cu_seqlens_q, q must be (B, S_q, H, D), got shape {tuple(q.shape)}; "
                             "pass cu_seqlens_q for packed queries")
        batch = q.shape[0]
    if page_table is not None:
        check_index_tensor("page_table", page_table, 2, device)
        if cu_seqlens_k is not None:
            raise ValueError("page_table cannot be combined with cu_seqlens_k: give each sequence's key count "
                             "with seqused_k")
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for a batch of {batch}")
        layout = "a paged cache (num_pages, page_size, H_k, D)"
        rank = 4
    elif cu_seqlens_k is not None:
        if cu_seqlens_k.numel() != batch + 1:
            raise ValueError(f"cu_seqlens_k has {cu_seqlens_k.numel()} entries; the batch of {batch} needs "
                             f"{batch + 1}")
        layout, rank = "packed (total_k, H_k, D) with cu_seqlens_k", 3
    else:
        layout, rank = "(B, S_k, H_k, D)", 4
    for name, t in (("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {layout}, got shape {tuple(t.shape)}")
        if page_table is None and cu_seqlens_k is None and t.shape[0] != batch:
            raise ValueError(f"{name} has batch {t.shape[0]} but the queries have {batch}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in all but their head dim")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None and t.shape[0] != batch:
            raise ValueError(f"{name} has {t.shape[0]} entries for a batch of {batch}")
    return batch


#: fmha.attention_with_kvcache's argument names as FlashAttention's callers spell them
_VARLEN_NAMES = {"block_table": "page_table", "k_cache": "k", "v_cache": "v", "cache_seqlens": "seqused_k"}
_KVCACHE_NAMES = {"block_table": "page_table", "k_new": "k", "v_new": "v", "scale_k": "k_descale",
                  "scale_v": "v_descale"}


def _attention_with_kvcache(*args, caller_names: dict, **kwargs):
    """``fmha.attention_with_kvcache``, its errors naming the arguments as FlashAttention's
    caller passed them (``caller_names``: fmha's name -> the caller's)."""
    try:
        return fmha.attention_with_kvcache(*args, **kwargs)
    except (ValueError, TypeError) as e:
        pattern = r"\b(" + "|".join(caller_names) + r")\b"
        text = re.sub(pattern, lambda m: caller_names[m.group(1)], str(e))
        if text == str(e):
            raise
        raise type(e)(text) from e


def _serves_as_cache(k, cu_seqlens_q, cu_seqlens_k, seqused_q, page_table, grad: bool) -> bool:
    """Whether fmha.attention_with_kvcache computes the call as it is: dense queries or packed
    ones (a mixed batch), nothing to differentiate, and a dense cache or one whose page size its
    paged cache takes."""
    if seqused_q is not None or cu_seqlens_k is not None or grad:
        return False
    if page_table is None:
        return True
    page_size = k.shape[1]
    return page_size in PAGE_SIZES and (k.shape[0] < 2 or k.stride(0) == page_size * k.stride(1))


def flash_attn_varlen_func(
    q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
    min_seqlen_k=None, seqused_q=None, seqused_k=None, gather_kv_indices=None, page_table=None,
    softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1,
    pack_gqa=None, deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None,
    block_sparse_tensors=None, aux_tensors=None, aux_scalars=None, return_lse=False, scheduler_metadata=None,
    seqlen_k_per_split=None, disable_scheduler_metadata=False, gather_bwd_recompute_p=False,
    gather_bwd_token_chunk=None,
):
    """FlashAttention-4's ``flash_attn_varlen_func``. Queries: packed (T_q, H_q, D) with
    ``cu_seqlens_q``, or dense (B, S_q, H_q, D); ``seqused_q`` (B,) keeps only each sequence's
    first rows. Keys: packed with ``cu_seqlens_k``, dense (B, S_k, H_k, D), or a paged cache
    (num_pages, page_size, H_k, D) with ``page_table`` (B, max_pages) int32; ``seqused_k`` (B,)
    keeps only each sequence's first keys. Returns ``(out, lse)``: out like q with D_v, lse
    (H_q, T_q) for packed queries or (B, H_q, S_q), fp32, when ``return_lse`` or an input
    requires grad (else None). Bottom-right masks per sequence; windows, sinks, softcap as in
    ``flash_attn_func``. ``max_seqlen_*``, ``min_seqlen_k``, ``num_splits``, ``pack_gqa`` and the
    scheduler arguments are hints. Query rows that ``seqused_q`` or ``cu_seqlens_q`` leave out come
    back as zeros (LSE -inf) on the gather path; FlashAttention leaves them unwritten, as the
    cache path does (packed queries over a cache: unspecified)."""
    _refuse_fa4_features(qv, gather_kv_indices, score_mod, score_mod_bwd, mask_mod, aux_tensors, aux_scalars,
                         block_sparse_tensors)
    _check_gather_backward_options(gather_bwd_recompute_p, gather_bwd_token_chunk)
    _require_tensors(q=q, k=k, v=v)
    batch = _check_varlen_layout(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table)
    q, k, v, learnable_sink = (kernel_layout(t) for t in (q, k, v, learnable_sink))
    check_learnable_sink(learnable_sink, q.shape[-2])
    want_lse = wants_lse(return_lse, q, k, v, learnable_sink)
    window = window_fa4(causal, window_size)
    common = dict(window_size=window, softmax_scale=softmax_scale, softcap=_softcap(softcap), sinks=learnable_sink)
    deterministic = bool(deterministic)
    plain = seqused_q is None and seqused_k is None and page_table is None
    if plain and cu_seqlens_q is None and cu_seqlens_k is None:
        result = fmha.attention(q, k, v, mask_align="bottom_right", return_lse=want_lse,
                                deterministic=deterministic, **common)
        return _fa4_result(result, want_lse, return_lse)
    max_q, max_k = _host_int(max_seqlen_q), _host_int(max_seqlen_k)
    if (plain and cu_seqlens_q is not None and cu_seqlens_k is not None and max_q is not None
            and max_k is not None and q.device.type == "cuda"):
        # both bounds given: fmha checks the offsets on the device, without a sync
        result = fmha.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, mask_align="bottom_right",
                                       return_lse=want_lse, deterministic=deterministic, **common)
        return _fa4_result(result, want_lse, return_lse)
    if _serves_as_cache(k, cu_seqlens_q, cu_seqlens_k, seqused_q, page_table, needs_grad(q, k, v, learnable_sink)):
        lengths = seqused_k
        if lengths is None and page_table is not None:  # every page of the table is used
            lengths = torch.full((batch,), page_table.shape[1] * k.shape[1], dtype=torch.int32, device=q.device)
        if lengths is None:  # a dense cache without seqused_k: every row of it is used
            lengths = torch.full((batch,), k.shape[1], dtype=torch.int32, device=q.device)
        packed = dict(cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_q) if cu_seqlens_q is not None else \
            dict(num_splits=_splits_hint(num_splits))
        # packed queries on a GPU take the cache only where a kernel serves it (decided before any
        # launch, remembered by its dispatch memo); else the gathered rows go to
        # fmha.attention_varlen, whose kernels may still serve them (another architecture, fp8)
        backend = "kernel" if cu_seqlens_q is not None and q.device.type == "cuda" else "auto"
        try:
            result = _attention_with_kvcache(q, k, v, lengths, block_table=page_table, causal=False,
                                             return_lse=want_lse, backend=backend, caller_names=_VARLEN_NAMES,
                                             **packed, **common)
            return _fa4_result(result, want_lse, return_lse)
        except fmha.UnsupportedError:
            pass
    out, lse = packing.attend_gathered(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, seqused_q=seqused_q, seqused_k=seqused_k,
        page_table=page_table, batch=batch, want_lse=want_lse, mask_align="bottom_right",
        deterministic=deterministic, **common)
    return out, lse_for_caller(lse, return_lse)


def _cache_lengths(cache_seqlens, batch: int, capacity: int, device: torch.device) -> torch.Tensor:
    """FlashAttention-3's cache_seqlens (an int, a (B,) int32 tensor, or None: the whole cache)."""
    if cache_seqlens is None:
        return torch.full((batch,), capacity, dtype=torch.int32, device=device)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        return torch.full((batch,), cache_seqlens, dtype=torch.int32, device=device)
    check_index_tensor("cache_seqlens", cache_seqlens, 1, device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for a batch of {batch}")
    return cache_seqlens


def _append_new_keys(k_cache, v_cache, k_new, v_new, lengths, page_table, cu_seqlens_k_new, batch: int):
    """Write k_new/v_new into the cache after each sequence's ``lengths[b]`` keys (in place, any
    strides); returns the sequences' key counts with them, (B,) int32."""
    if cu_seqlens_k_new is not None:
        check_index_tensor("cu_seqlens_k_new", cu_seqlens_k_new, 1, k_cache.device)
        if k_new.dim() != 3 or cu_seqlens_k_new.numel() != batch + 1:
            raise ValueError("with cu_seqlens_k_new (B + 1 entries), k and v must be packed (total_new, H_k, D)")
        offsets = cu_seqlens_k_new.tolist()  # host sync: the rows to write
        new_lengths = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
        if offsets[0] != 0 or min(new_lengths, default=0) < 0 or offsets[-1] > k_new.shape[0]:
            raise ValueError(f"cu_seqlens_k_new must start at 0, never decrease and end within k's "
                             f"{k_new.shape[0]} rows, got {offsets}")
        flat_k, flat_v = k_new[:offsets[-1]], v_new[:offsets[-1]]
    else:
        if k_new.dim() != 4 or k_new.shape[0] != batch:
            raise ValueError(f"k and v (the new keys) must be (B, S_new, H_k, D) with B = {batch}, got "
                             f"{tuple(k_new.shape)}; packed new keys need cu_seqlens_k_new")
        new_lengths = [k_new.shape[1]] * batch
        flat_k, flat_v = k_new.flatten(0, 1), v_new.flatten(0, 1)
    if k_new.shape[:-1] != v_new.shape[:-1] or k_new.shape[-2:] != k_cache.shape[-2:] \
            or v_new.shape[-1] != v_cache.shape[-1]:
        raise ValueError(f"k {tuple(k_new.shape)} and v {tuple(v_new.shape)} must match the caches' heads and "
                         f"head dims ({tuple(k_cache.shape[-2:])}, {v_cache.shape[-1]})")
    if k_new.dtype != k_cache.dtype or v_new.dtype != v_cache.dtype:
        raise TypeError(f"k and v must have the caches' dtype ({str(k_cache.dtype)[6:]}), got "
                        f"{str(k_new.dtype)[6:]} and {str(v_new.dtype)[6:]}")
    old = lengths.tolist()  # host sync, as for the new keys' offsets
    page_size = k_cache.shape[1]
    capacity = page_table.shape[1] * page_size if page_table is not None else k_cache.shape[1]
    for b, (n, extra) in enumerate(zip(old, new_lengths)):
        if n < 0 or n + extra > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n} plus {extra} new keys does not fit the cache's {capacity} "
                             "positions per sequence")
    total = [n + extra for n, extra in zip(old, new_lengths)]
    if sum(new_lengths):
        device = k_cache.device
        _, seq, pos = packing.span_index([0] * batch, new_lengths, device)
        pos = pos + torch.tensor(old, dtype=torch.long, device=device)[seq]
        if page_table is not None:
            packing.paged_spans(page_table, total, page_size, k_cache.shape[0])  # every page used exists
            where = (page_table[seq, pos // page_size].long(), pos % page_size)
        else:
            where = (seq, pos)
        k_cache.index_put_(where, flat_k)
        v_cache.index_put_(where, flat_v)
    return torch.tensor(total, dtype=torch.int32, device=k_cache.device)


def flash_attn_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
    cache_batch_idx=None, cache_leftpad=None, page_table=None, cu_seqlens_q=None, cu_seqlens_k_new=None,
    max_seqlen_q=None, rotary_seqlens=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
    causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
    scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0, return_softmax_lse=False,
):
    """FlashAttention-3's ``flash_attn_with_kvcache`` (FlashAttention-4 has no such function):
    attention of the new queries q (B, S_q, H_q, D), or packed (T_q, H_q, D) with
    ``cu_seqlens_q``, over a dense (B, S_cache, H_k, D) or paged (num_pages, page_size, H_k, D,
    with ``page_table``) cache holding ``cache_seqlens`` keys per sequence (an int, a (B,) int32
    tensor, or None: the whole cache). New keys ``k``/``v`` ((B, S_new, H_k, D), or packed with
    ``cu_seqlens_k_new``) are written into the cache first, in place; ``cache_seqlens`` is not
    changed. Bottom-right masks; ``window_size`` sides negative or None are unbounded. Returns
    out, or ``(out, softmax_lse)`` with ``return_softmax_lse`` (FlashAttention-3 appends its
    split-KV scratch tensors there too; fmha has none to return). Not differentiable, as in
    FlashAttention-3. An fp8 (e4m3) cache under a bf16/fp16 q takes ``k_descale``/``v_descale``
    (float32, (B, H_k) or broadcastable) as its dequantization factors, for dense queries (fmha's
    ``scale_k``/``scale_v``; FlashAttention-3 itself needs an fp8 q there)."""
    fp8_cache = (isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float8_e4m3fn
                 and isinstance(q, torch.Tensor) and q.dtype in (torch.float16, torch.bfloat16))
    descaled = k_descale is not None or v_descale is not None
    refuse_unsupported((
        ("qv", qv is not None, "MLA's absorbed query against V"),
        ("rotary_cos", rotary_cos is not None, "rotary embedding applied inside attention"),
        ("rotary_sin", rotary_sin is not None, "rotary embedding applied inside attention"),
        ("rotary_seqlens", rotary_seqlens is not None, "rotary embedding applied inside attention"),
        ("cache_batch_idx", cache_batch_idx is not None, "indirection from batch entries to cache rows"),
        ("cache_leftpad", cache_leftpad is not None, "caches whose keys start after left padding"),
        ("q_descale", q_descale is not None, "per-(batch, head) fp8 descale tensors"),
        ("k_descale", k_descale is not None and not fp8_cache, "descale tensors other than an fp8 cache's under "
                                                               "a bf16/fp16 q"),
        ("v_descale", v_descale is not None and not fp8_cache, "descale tensors other than an fp8 cache's under "
                                                               "a bf16/fp16 q"),
        ("k_descale", descaled and (cu_seqlens_q is not None or cu_seqlens_k_new is not None),
         "an fp8 cache's descale tensors with packed queries or new keys"),
        ("attention_chunk", bool(attention_chunk), "chunked attention masks"),
    ))
    _require_tensors(q=q, k_cache=k_cache, v_cache=v_cache)
    if (k is None) != (v is None):
        raise ValueError("pass both k and v (the new keys and values), or neither")
    if cu_seqlens_k_new is not None and k is None:
        raise ValueError("cu_seqlens_k_new describes new keys: pass k and v too")
    if cu_seqlens_q is not None:
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1, q.device)
        batch = cu_seqlens_q.numel() - 1
    else:
        batch = q.shape[0]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, S_cache, H_k, D), or (num_pages, page_size, H_k, D) with "
                             f"page_table, got shape {tuple(t.shape)}")
    if page_table is not None:
        check_index_tensor("page_table", page_table, 2, q.device)
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for a batch of {batch}")
        capacity = page_table.shape[1] * k_cache.shape[1]
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a dense cache has one row per sequence: k_cache has {k_cache.shape[0]} for a "
                             f"batch of {batch} (cache_batch_idx, which would map them, is not supported)")
        capacity = k_cache.shape[1]
    lengths = _cache_lengths(cache_seqlens, batch, capacity, q.device)
    window = window_fa3(causal, window_size)
    common = dict(window_size=window, softmax_scale=softmax_scale, softcap=_softcap(softcap))
    if k is None:  # the caches are only read: copy them as FlashAttention would if unaligned
        k_cache, v_cache = kernel_layout(k_cache), kernel_layout(v_cache)
    q = kernel_layout(q)
    # packed queries: their new keys are written below, then the call goes through flash_attn_varlen_func
    if cu_seqlens_k_new is None and cu_seqlens_q is None and _serves_as_cache(k_cache, None, None, None, page_table,
                                                                              grad=False):
        # FlashAttention-3's num_splits: 0 lets it choose (fmha's None), n >= 1 asks for n
        splits = num_splits if isinstance(num_splits, int) and num_splits > 0 else None
        if descaled:  # the fp8 cache's dequantization factors; a missing one is 1
            one = torch.ones((), dtype=torch.float32, device=q.device)
            common.update(scale_k=one if k_descale is None else k_descale,
                          scale_v=one if v_descale is None else v_descale)
        return _attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=page_table, k_new=k, v_new=v,
                                       causal=False, return_lse=bool(return_softmax_lse), num_splits=splits,
                                       caller_names=_KVCACHE_NAMES, **common)
    if k is not None:
        lengths = _append_new_keys(k_cache, v_cache, kernel_layout(k), kernel_layout(v), lengths, page_table,
                                   cu_seqlens_k_new, batch)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(
            q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=lengths, page_table=page_table,
            return_lse=True, **common)
    return (out, lse) if return_softmax_lse else out
