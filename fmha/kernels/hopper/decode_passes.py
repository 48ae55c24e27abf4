"""The small passes around the Hopper decode kernel, each one launch: the split-KV combine
(``kernels/common/split_combine.py``) and the KV-cache append (``kernels/common/kv_append.py``),
compiled for sm_90a."""

from __future__ import annotations

from fmha.jit import disk_cache
from fmha.jit.compile import compile_for, cutlass_dtype, fake_rows, fake_vector

from .config import ARCH


def compile_split_combine(cfg, extra_options: str = ""):
    """Compile the split-KV combine pass (``kernels/common/split_combine.py``) for sm_90a."""
    import cutlass
    from cutlass import Int32

    from ..common.split_combine import SplitCombine

    o_parts = fake_rows(cutlass.Float32, 4, cfg.head_dim)
    lse_parts = fake_rows(cutlass.Float32, 3, None, align_bytes=4)
    o = fake_rows(cutlass_dtype(cfg.out_dtype), 4, cfg.head_dim)
    lse = fake_rows(cutlass.Float32, 3, None, align_bytes=4) if cfg.has_lse else None
    return compile_for(ARCH, SplitCombine(cfg), o_parts, lse_parts, o, lse, Int32(1), Int32(1),
                       extra_options=extra_options)


def compile_kv_append(cfg, extra_options: str = ""):
    """Compile the KV-cache append pass (``kernels/common/kv_append.py``) for sm_90a: any strides
    but a unit innermost one, no alignment (its loads and stores are scalar)."""
    import cutlass
    from cutlass import Int32

    from ..common.kv_append import KvAppend

    elem = cutlass_dtype(cfg.dtype)
    one = elem.width // 8
    k_new, k = (fake_rows(elem, 4, cfg.head_dim, align_bytes=one) for _ in range(2))
    v_new, v = (fake_rows(elem, 4, cfg.head_dim_v, align_bytes=one) for _ in range(2))
    table = fake_rows(cutlass.Int32, 2, None, align_bytes=4) if cfg.paged else None
    return compile_for(ARCH, KvAppend(cfg), k_new, v_new, k, v, fake_vector(cutlass.Int32), table, Int32(1),
                       extra_options=extra_options)


_kv_appends: dict = {}


def append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity: int) -> None:
    """Write k_new/v_new (B, S_new, H_k, D) at positions ``cache_seqlens[b] ..`` of each sequence
    (dense or paged cache), one launch; positions that do not fit write nothing."""
    from ..common.kv_append import KvAppendConfig

    if k_new.numel() == 0 or v_new.numel() == 0:
        return  # nothing to write (and an empty grid is not a launch)
    # the pass takes any strides but a unit innermost one
    k_new, v_new = (t if t.stride(-1) == 1 else t.contiguous() for t in (k_new, v_new))
    cfg = KvAppendConfig(k_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], block_table is not None)
    kernel = _kv_appends.get(cfg)
    if kernel is None:
        kernel = _kv_appends[cfg] = disk_cache.load_or_compile(cfg, compile_kv_append)
    kernel(k_new, v_new, k_cache, v_cache, cache_seqlens, block_table, capacity)
