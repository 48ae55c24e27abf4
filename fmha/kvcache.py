"""Attention over a KV cache, dense or paged (serving: decode and chunked prefill).

``attention_with_kvcache`` takes the new query rows of each sequence and its cache: dense
(B, S_max, H_k, D), or paged (num_pages, page_size, H_k, D) with a ``block_table`` (B, max_pages)
that maps sequence b's logical key position p to page ``block_table[b, p // page_size]``, row
``p % page_size`` (docs/semantics.md, "KV cache"). The query rows are the last of each sequence:
masks are bottom-right aligned. Optional ``k_new``/``v_new`` are first written into the cache at
``cache_seqlens[b]`` and attended to as well (``cache_seqlens`` itself is not changed, as in
FlashAttention's ``flash_attn_with_kvcache``).

On an SM90 GPU the Hopper forward kernel serves it in its decode configuration
(``fmha.split_kv``: the query heads of a GQA group packed into one query tile, the keys split
over CTAs when the tiles cannot fill the GPU, pages read through the block table). That path
reads nothing back from the GPU: ``cache_seqlens`` and the block table are checked on the device
(``fmha.device_errors``). Elsewhere the exact reference runs; it reads them on the host (a sync)
and checks them there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import device_errors
from .backends import check_backend_name, recall_dispatch, remember_dispatch
from .dispatch import memo_key, pointers_aligned
from .masking import MaskSpec
from .problem import (INPUT_DTYPES, ScoreScaling, accumulate_dtype, default_out_dtype, kept_pairs, matmul_flops,
                      output_dtypes_for)
from .options import parse_cached
from .validation import _check_layout, _dtype_name, _require_tensor, check_index_tensor, check_sinks

#: page sizes a paged cache may have (the kernel loads each tile in runs that stay within a page)
PAGE_SIZES = tuple(range(1, 257))


def validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out_dtype,
                     cu_seqlens_q=None):
    """Checks that need no values; returns (paged, page_size, capacity, out_dtype). With
    ``cu_seqlens_q`` q holds packed sequences (T_q, H_q, D)."""
    packed = cu_seqlens_q is not None
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _require_tensor(name, t)
        dim = 3 if packed and name == "q" else 4
        if t.dim() != dim:
            raise ValueError(f"{name} must be {dim}-D"
                             + (" (T_q, H_q, D): packed sequences, as cu_seqlens_q is given" if dim == 3 else "")
                             + f", got shape {tuple(t.shape)}")
        if t.dtype not in INPUT_DTYPES:
            raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; use one of "
                            f"{', '.join(_dtype_name(d) for d in INPUT_DTYPES)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        _check_layout(name, t)
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in cache_dtypes_for(q.dtype):
        raise TypeError(f"k_cache and v_cache must share a dtype, q's or (under a float16/bfloat16 q) "
                        f"float8_e4m3fn; got q {_dtype_name(q.dtype)}, k_cache {_dtype_name(k_cache.dtype)}, "
                        f"v_cache {_dtype_name(v_cache.dtype)}")
    heads_q, head_dim = q.shape[-2:]
    if packed:
        check_index_tensor("cu_seqlens_q", cu_seqlens_q, 1, q.device)
        if cu_seqlens_q.shape[0] < 1:
            raise ValueError("cu_seqlens_q needs at least one entry (B + 1 offsets)")
        batch = cu_seqlens_q.shape[0] - 1
    else:
        batch = q.shape[0]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                         f"their first three dims, and k_cache's head dim must be q's ({head_dim})")
    heads_k = k_cache.shape[2]
    if heads_k == 0 or heads_q % heads_k:
        raise ValueError(f"the query heads ({heads_q}) must be a multiple of the cache's K/V heads ({heads_k})")
    check_index_tensor("cache_seqlens", cache_seqlens, 1, q.device)
    if cache_seqlens.shape[0] != batch:
        raise ValueError(f"cache_seqlens has {cache_seqlens.shape[0]} entries for a batch of {batch}")
    paged = block_table is not None
    if paged:
        check_index_tensor("block_table", block_table, 2, q.device)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table has {block_table.shape[0]} rows for a batch of {batch}")
        page_size = k_cache.shape[1]
        if page_size not in PAGE_SIZES:
            raise ValueError(f"the page size (k_cache.shape[1]) must be from 1 to 256 keys, got {page_size}")
        capacity = block_table.shape[1] * page_size
    else:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a dense cache has one row per sequence: k_cache.shape[0] = {k_cache.shape[0]}, "
                             f"batch {batch} (pass block_table= for a paged cache)")
        page_size, capacity = None, k_cache.shape[1]
    if (k_new is None) != (v_new is None):
        raise ValueError("pass both k_new and v_new, or neither")
    if packed and k_new is not None:
        raise ValueError("k_new/v_new are appended for dense query batches; with cu_seqlens_q write the new keys "
                         "into the cache first (cache_seqlens then counts them)")
    if k_new is not None:
        for name, t, like in (("k_new", k_new, k_cache), ("v_new", v_new, v_cache)):
            _require_tensor(name, t)
            dtypes = (like.dtype,) if like.dtype == q.dtype else (q.dtype, like.dtype)
            if t.dim() != 4 or t.shape[0] != batch or t.shape[2:] != like.shape[2:] or t.dtype not in dtypes:
                raise ValueError(f"{name} must be (B, S_new, H_k, D) = ({batch}, S_new, {like.shape[2]}, "
                                 f"{like.shape[3]}) in {' or '.join(_dtype_name(d) for d in dtypes)}, got "
                                 f"{tuple(t.shape)} {_dtype_name(t.dtype)}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
        if k_new.shape[1] != v_new.shape[1]:
            raise ValueError(f"k_new and v_new have {k_new.shape[1]} and {v_new.shape[1]} rows")
    if out_dtype is None:
        out_dtype = default_out_dtype(q.dtype)
    if out_dtype not in output_dtypes_for(q.dtype):
        raise TypeError(f"unsupported out_dtype {_dtype_name(out_dtype)} for {_dtype_name(q.dtype)} input")
    return paged, page_size, capacity, out_dtype


def cache_dtypes_for(q_dtype: torch.dtype) -> tuple:
    """The K/V cache dtypes a query dtype can attend to: its own, and fp8 (e4m3) under a 16-bit
    query (values = stored values x ``scale_k`` / ``scale_v``)."""
    if q_dtype in (torch.float16, torch.bfloat16):
        return (q_dtype, torch.float8_e4m3fn)
    return (q_dtype,)


def quantize_for_cache(x: torch.Tensor, scale, cache_dtype: torch.dtype) -> torch.Tensor:
    """New keys or values as a cache of ``cache_dtype`` stores them: unchanged in their own dtype;
    a 16-bit tensor for an fp8 cache divided by the cache's dequantization ``scale`` (a float, or
    a tensor that broadcasts against ``x``) and rounded to nearest, saturating at e4m3's largest
    finite value (448), NaN kept."""
    if x.dtype == cache_dtype:
        return x
    scaled = x.float() / scale if isinstance(scale, torch.Tensor) else x.float() * (1.0 / scale)
    # CUDA's cast turns values past the largest finite one into NaN (the CPU's saturates): clamp first
    finite_max = torch.finfo(cache_dtype).max
    return scaled.clamp(-finite_max, finite_max).to(cache_dtype)


def check_cache_scales(scale_k, scale_v, batch: int, heads_k: int, cache_dtype: torch.dtype, device, softcap):
    """Tensor dequantization factors of an fp8 cache: both float32 on the query's device, one
    per tensor (shape () or (1,)), per K/V head (H_k,) or per sequence and K/V head (B, H_k), as
    FlashAttention-3's descale tensors. Their values are not read (no host sync)."""
    for name, t in (("scale_k", scale_k), ("scale_v", scale_v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError("scale_k and scale_v are both floats or both tensors; got a tensor and a "
                            f"{type(t).__name__}")
        if cache_dtype != torch.float8_e4m3fn:
            raise ValueError(f"tensor scales are an fp8 cache's dequantization factors; the cache is "
                             f"{_dtype_name(cache_dtype)}: pass floats")
        if t.dtype != torch.float32 or t.device != device:
            raise TypeError(f"{name} must be a float32 tensor on {device}, got {_dtype_name(t.dtype)} on {t.device}")
        if tuple(t.shape) not in ((), (1,), (heads_k,), (batch, heads_k)):
            raise ValueError(f"{name} must have shape (), (1,), (H_k,) = ({heads_k},) or (B, H_k) = ({batch}, "
                             f"{heads_k}), got {tuple(t.shape)}")
    if softcap:
        raise ValueError("softcap with tensor scales is not served (the cap follows the score scale): pass float "
                         "scales, or no softcap")


def cache_scales_2d(scale: torch.Tensor, batch: int, heads_k: int) -> torch.Tensor:
    """A checked tensor scale (``check_cache_scales``) as a (B, H_k) view (stride 0 where broadcast)."""
    if scale.dim() == 2:
        return scale
    return scale.reshape(1, -1).expand(batch, heads_k)


@dataclass(frozen=True)
class DecodeProblem(ScoreScaling):
    """What a kernel needs to know of an ``attention_with_kvcache`` call (no tensor values)."""

    batch: int
    seqlen_q: int
    heads_q: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    out_dtype: torch.dtype
    mask: MaskSpec  # bottom-right
    page_size: int  # 0: dense cache
    capacity: int  # keys a sequence can hold
    num_pages: int  # paged: pages in the cache; dense: B
    seqlen_new: int
    score_scale: float
    output_scale: float
    return_lse: bool
    num_splits: Optional[int] = None  # None: the kernel's heuristic
    softcap: float = 0.0  # as AttentionProblem's
    has_sinks: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: q holds packed sequences (T_q, H_q, D) at ``cu_seqlens_q`` (a mixed batch of prefills and
    #: decodes); ``seqlen_q`` is then the longest's bound (``max_seqlen_q``)
    packed_q: bool = False
    #: the cache's dtype where it is not ``dtype`` (float8_e4m3fn under a 16-bit query)
    kv_dtype: Optional[torch.dtype] = None
    #: the fp8 cache's scale_k / scale_v are tensors ((B, H_k) on the device); the score and
    #: output scales above then leave them out
    kv_scale_tensors: bool = False

    def flops(self, cache_lengths, seqlens_q=None) -> float:
        """Matmul FLOPs the bottom-right mask keeps (4 * kept (i, j) pairs * D per head, D and
        D_v apart), over each sequence's keys (its cache length plus the new keys);
        ``seqlens_q``: each sequence's query rows (packed queries), else ``seqlen_q`` each."""
        rows = seqlens_q if seqlens_q is not None else [self.seqlen_q] * len(cache_lengths)
        kept = sum(kept_pairs(int(n_q), int(length) + self.seqlen_new, self.mask)
                   for n_q, length in zip(rows, cache_lengths))
        return matmul_flops(kept * self.heads_q, self.head_dim, self.head_dim_v)


def decode_backend(backend: str, problem: DecodeProblem) -> tuple:
    """(name of what serves ``problem`` under ``backend``, the reasons no kernel does, if any)."""
    from . import backends
    from .problem import KernelOptions

    backends.check_backend_name(backend)
    if backend == "reference":
        return "reference", []
    chosen, reasons = backends.unsupported_reasons(problem, KernelOptions(), kind=backends.DECODE)
    return ("reference" if chosen is None else chosen.name), reasons


def _decode_runner(backend: str, problem: DecodeProblem):
    """The kernel runner for ``problem``, or None where the reference runs it."""
    from . import backends
    from .problem import KernelOptions

    chosen = backends.select(backends.DECODE, backend, problem, KernelOptions())
    if chosen is backends.REFERENCE:
        return None
    return backends.runner_for(backends.DECODE, chosen, problem, KernelOptions())


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


def decode_problem(q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None,
                   causal=True, window_size=(None, None), softmax_scale=None, softcap=0.0, sinks=None, scale_q=1.0,
                   scale_k=1.0, scale_v=1.0, inv_scale_o=1.0, return_lse=False, out_dtype=None,
                   num_splits=None, cu_seqlens_q=None, max_seqlen_q=None) -> tuple:
    """Validate an ``attention_with_kvcache`` call (nothing read from the GPU): its
    ``DecodeProblem`` and the scales as the reference takes them (tensor ``scale_k``/``scale_v``
    are checked here and left out of them: 1.0 each)."""
    paged, page_size, capacity, out_dtype = validate_kvcache(q, k_cache, v_cache, cache_seqlens, block_table,
                                                             k_new, v_new, out_dtype, cu_seqlens_q)
    scale_tensors = isinstance(scale_k, torch.Tensor) or isinstance(scale_v, torch.Tensor)
    if scale_tensors:
        check_cache_scales(scale_k, scale_v, cache_seqlens.shape[0], k_cache.shape[2], k_cache.dtype, q.device,
                           softcap)
        scale_k = scale_v = 1.0
    packed = cu_seqlens_q is not None
    if max_seqlen_q is not None and not packed:
        raise ValueError("max_seqlen_q is for packed queries (cu_seqlens_q); a dense q's rows are q.shape[1]")
    if max_seqlen_q is not None and (isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, int)
                                     or max_seqlen_q < 0):
        raise ValueError(f"max_seqlen_q must be a non-negative int or None, got {max_seqlen_q!r}")
    if packed and num_splits not in (None, 1):
        raise ValueError("num_splits: packed queries (cu_seqlens_q) are not split over CTAs yet; leave it None")
    # the public options' one definition; a cache's masks are bottom-right
    options = parse_cached(causal=causal, window_size=window_size, mask_align="bottom_right",
                           softmax_scale=softmax_scale, softcap=softcap, scale_q=scale_q, scale_k=scale_k,
                           scale_v=scale_v, inv_scale_o=inv_scale_o)
    mask = options.mask
    scales = dict(softmax_scale=options.softmax_scale, scale_q=options.scale_q, scale_k=options.scale_k,
                  scale_v=options.scale_v, inv_scale_o=options.inv_scale_o, softcap=options.softcap)
    check_sinks(sinks, q.shape[-2], q.device)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")
    if paged and k_cache.shape[0] > 1 and (k_cache.stride(0) != page_size * k_cache.stride(1)
                                           or v_cache.stride(0) != page_size * v_cache.stride(1)):
        raise ValueError("a paged cache's pages must follow each other in memory (stride(0) == page_size * "
                         "stride(1)); allocate it as one (num_pages, page_size, H_k, D) tensor")
    heads_q, head_dim = q.shape[-2:]
    if packed:  # without max_seqlen_q every row may be one sequence's: no host read
        batch, s_q = cu_seqlens_q.shape[0] - 1, (q.shape[0] if max_seqlen_q is None else max_seqlen_q)
    else:
        batch, s_q = q.shape[:2]
    s_new = 0 if k_new is None else k_new.shape[1]
    if s_new > capacity:
        raise ValueError(f"{s_new} new keys do not fit a cache of {capacity} positions per sequence"
                         + (" (block_table columns x page size)" if paged else ""))
    softmax = scales["softmax_scale"] if scales["softmax_scale"] is not None else 1.0 / math.sqrt(head_dim)
    problem = DecodeProblem(
        batch=batch, seqlen_q=s_q, heads_q=heads_q, heads_k=k_cache.shape[2], head_dim=head_dim,
        head_dim_v=v_cache.shape[-1], dtype=q.dtype, out_dtype=out_dtype, mask=mask, page_size=page_size or 0,
        capacity=capacity, num_pages=k_cache.shape[0], seqlen_new=s_new,
        score_scale=softmax * scales["scale_q"] * scales["scale_k"],
        output_scale=scales["scale_v"] * scales["inv_scale_o"], return_lse=return_lse, num_splits=num_splits,
        softcap=scales["softcap"], has_sinks=sinks is not None, device=q.device, packed_q=packed,
        kv_dtype=None if k_cache.dtype == q.dtype else k_cache.dtype, kv_scale_tensors=scale_tensors)
    return problem, scales


def _check_outputs(problem: DecodeProblem, q, out, lse) -> None:
    want_o = tuple(q.shape[:-1]) + (problem.head_dim_v,)
    want_l = (problem.heads_q, q.shape[0]) if problem.packed_q else (problem.batch, problem.heads_q, problem.seqlen_q)
    for name, t, shape, dtype in (("out", out, want_o, problem.out_dtype), ("lse", lse, want_l, accumulate_dtype(problem.dtype))):
        if t is None:
            continue
        _require_tensor(name, t)
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != problem.device:
            raise ValueError(f"{name} must be a {shape} {_dtype_name(dtype)} tensor on {problem.device}, got "
                             f"{tuple(t.shape)} {_dtype_name(t.dtype)} on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if name == "out":
            _check_layout(name, t)


def attention_with_kvcache(
    q, k_cache, v_cache, cache_seqlens, *, block_table=None, k_new=None, v_new=None, cu_seqlens_q=None,
    max_seqlen_q=None, causal=True, window_size=(None, None), softmax_scale=None, softcap=0.0, sinks=None,
    scale_q=1.0, scale_k=1.0, scale_v=1.0, inv_scale_o=1.0, return_lse=False, out_dtype=None, out=None, lse=None,
    backend="auto", num_splits=None,
):
    """Attention of the new query rows q (B, S_q, H_q, D) over each sequence's cached keys (and
    ``k_new``/``v_new``, appended to the cache first). ``cache_seqlens`` (B,) int32: valid
    cached keys per sequence. Dense cache (B, S_max, H_k, D); paged (num_pages, page_size, H_k,
    D) with ``block_table`` (B, max_pages) int32. Masks are bottom-right aligned: with ``causal``
    (the default) row i of S_q sees keys up to L - S_q + i, L the sequence's length including
    the new keys. Returns O (B, S_q, H_q, D_v), or (O, LSE (B, H_q, S_q)) with ``return_lse``;
    ``out``/``lse`` preallocated (contiguous) are written in place. ``softcap`` and ``sinks`` as in
    ``fmha.attention``.
    A mixed batch (chunked prefills and decodes in one call): q (T_q, H_q, D) packed, sequence b's
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32, B + 1), each attending to the first
    ``cache_seqlens[b]`` keys of its cache (its own new keys already written there); O is
    (T_q, H_q, D_v), LSE (H_q, T_q); rows past ``cu_seqlens_q[-1]`` (padding to a fixed size)
    belong to no sequence: their O and LSE are unspecified. ``max_seqlen_q`` bounds the rows of a sequence
    (default T_q); no ``k_new``/``v_new``, no split-KV.
    ``num_splits``: how many CTAs share each query tile's keys (split-KV); None lets the kernel
    choose (``fmha.split_kv.choose_num_splits``). An fp8 (e4m3) cache under a bf16/fp16 q holds
    keys and values divided by ``scale_k``/``scale_v``: floats, or float32 tensors of shape (),
    (H_k,) or (B, H_k) on q's device (read on the GPU, so they may change between CUDA-graph
    replays). On the kernel path ``cache_seqlens``,
    ``cu_seqlens_q`` and the block table are checked on the GPU: a bad value raises at a later
    call or at ``fmha.check_device_errors()``."""
    scale_tensors = isinstance(scale_k, torch.Tensor) or isinstance(scale_v, torch.Tensor)
    tensors = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out, lse, sinks, cu_seqlens_q)
    # a decode loop repeats its call: what validation and dispatch decided is reused (no key, and
    # the full path, where a tensor's place holds something else)
    scale_key, keyed = (scale_k, scale_v), tensors
    if scale_tensors:  # keyed by their layout, as the other tensors are (no alignment asked of them)
        keyed, scale_key = tensors + (scale_k, scale_v), ("tensors",)
    key = memo_key(keyed, ("kvcache", causal, window_size, softmax_scale, softcap, scale_q, scale_key,
                           inv_scale_o, return_lse, out_dtype, backend, num_splits, max_seqlen_q))
    hit = recall_dispatch(key) if key is not None else None
    if hit is not None and pointers_aligned(tensors):
        problem, runner = hit
    else:
        check_backend_name(backend)
        if out_dtype is None and isinstance(out, torch.Tensor):
            out_dtype = out.dtype
        problem, scales = decode_problem(
            q, k_cache, v_cache, cache_seqlens, block_table=block_table, k_new=k_new, v_new=v_new, causal=causal,
            window_size=window_size, softmax_scale=softmax_scale, softcap=softcap, sinks=sinks, scale_q=scale_q,
            scale_k=scale_k, scale_v=scale_v, inv_scale_o=inv_scale_o, return_lse=return_lse or lse is not None,
            out_dtype=out_dtype, num_splits=num_splits, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q)
        _check_outputs(problem, q, out, lse)
        runner = _decode_runner(backend, problem)
        if key is not None and runner is not None:  # the reference reads the values every call anyway
            remember_dispatch(key, problem, runner)
    batch, heads_q, s_new, page_size, capacity = (problem.batch, problem.heads_q, problem.seqlen_new,
                                                  problem.page_size, problem.capacity)
    paged, out_dtype, mask = block_table is not None, problem.out_dtype, problem.mask
    lse_shape = (heads_q, q.shape[0]) if problem.packed_q else (batch, heads_q, problem.seqlen_q)
    if out is None:
        out = torch.empty(q.shape[:-1] + (v_cache.shape[-1],), dtype=out_dtype, device=q.device)
    cache_scales = None  # (scale_k, scale_v) as (B, H_k) views
    if problem.kv_scale_tensors:
        cache_scales = tuple(cache_scales_2d(t, batch, problem.heads_k) for t in (scale_k, scale_v))
    if runner is not None:
        device_errors.raise_pending(q.device)
        lengths = cache_seqlens
        if s_new:
            new_scales = (scale_k, scale_v) if cache_scales is None else (cache_scales[0][:, None, :, None],
                                                                          cache_scales[1][:, None, :, None])
            runner.append(k_cache, v_cache, quantize_for_cache(k_new, new_scales[0], k_cache.dtype),
                          quantize_for_cache(v_new, new_scales[1], v_cache.dtype), cache_seqlens, block_table,
                          capacity)
            lengths = cache_seqlens + s_new
        if lse is None and return_lse:
            lse = torch.empty(lse_shape, dtype=accumulate_dtype(q.dtype), device=q.device)
        runner(problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks, cu_seqlens_q,
               **({"cache_scales": cache_scales} if cache_scales is not None else {}))
        device_errors.watch(q.device)
        return (out, lse) if return_lse else out
    from .reference import attention_reference, cast_output

    lengths = cache_seqlens.tolist()  # host read: the reference walks each sequence
    rows = _query_rows(problem, q, cu_seqlens_q)
    for b, n in enumerate(lengths):
        if n < 0 or n + s_new > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n}" + (f" plus {s_new} new keys" if s_new else "")
                             + f" does not fit the cache's {capacity} positions per sequence"
                             + (" (block_table columns x page size)" if paged else ""))
    num_pages = k_cache.shape[0]
    # every sequence's key positions are checked before the cache is written
    positions = [_key_positions(b, n + s_new, block_table, page_size, num_pages, q.device)
                 for b, n in enumerate(lengths)]
    def scales_of(b):  # sequence b's (scale_k, scale_v), broadcasting over (keys, H_k, D)
        if cache_scales is None:
            return scale_k, scale_v
        return cache_scales[0][b][None, :, None], cache_scales[1][b][None, :, None]

    if s_new:
        for b, (n, (rows_b, cols)) in enumerate(zip(lengths, positions)):
            sk, sv = scales_of(b)
            k_cache[rows_b[n:], cols[n:]] = quantize_for_cache(k_new[b], sk, k_cache.dtype)
            v_cache[rows_b[n:], cols[n:]] = quantize_for_cache(v_new[b], sv, v_cache.dtype)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=accumulate_dtype(q.dtype), device=q.device)
    lse.fill_(-math.inf)
    for b, ((pages, cols), q_rows) in enumerate(zip(positions, rows)):
        k, v = k_cache[pages, cols], v_cache[pages, cols]  # (L, H_k, D)
        if cache_scales is not None:  # dequantized here: ``scales`` holds 1.0 for them
            sk, sv = scales_of(b)
            k, v = k.float() * sk, v.float() * sv
        q_b = q[q_rows] if problem.packed_q else q[b]
        o_b, lse_b = attention_reference(q_b[None], k[None], v[None], mask=mask, sinks=sinks,
                                         compute_dtype=accumulate_dtype(q.dtype), **scales)
        if problem.packed_q:
            out[q_rows] = cast_output(o_b[0], out_dtype)
            lse[:, q_rows] = lse_b[0]
        else:
            out[b] = cast_output(o_b[0], out_dtype)
            lse[b] = lse_b[0]
    return (out, lse) if return_lse else out


def _query_rows(problem: DecodeProblem, q, cu_seqlens_q) -> list:
    """Each sequence's query rows: a slice of packed q (``cu_seqlens_q``, read on the host and
    checked here), or None per sequence for a dense batch."""
    if not problem.packed_q:
        return [None] * problem.batch
    offsets = cu_seqlens_q.tolist()
    for b in range(problem.batch):
        if not 0 <= offsets[b] <= offsets[b + 1] <= q.shape[0] or offsets[0] != 0:
            raise ValueError(f"cu_seqlens_q must rise from 0 to at most q.shape[0] = {q.shape[0]}; entries {b} and "
                             f"{b + 1} are {offsets[b]} and {offsets[b + 1]}")
        if offsets[b + 1] - offsets[b] > problem.seqlen_q:
            raise ValueError(f"sequence {b} has {offsets[b + 1] - offsets[b]} query rows, more than max_seqlen_q = "
                             f"{problem.seqlen_q}")
    return [slice(offsets[b], offsets[b + 1]) for b in range(problem.batch)]
