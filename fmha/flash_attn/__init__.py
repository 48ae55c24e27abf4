"""FlashAttention's Python API, computed by fmha: switch with
``from fmha.flash_attn import flash_attn_func`` (or ``flash_attn_varlen_func``,
``flash_attn_with_kvcache``).

``flash_attn_func`` and ``flash_attn_varlen_func`` take FlashAttention-4's arguments
(``flash_attn.cute``, 4.0.0b36) and return what it returns; ``flash_attn_with_kvcache`` takes
FlashAttention-3's (FlashAttention-4 has none). Features fmha does not have raise
``NotImplementedError`` naming the argument. docs/flash_attn.md says what runs where.
"""

from .interface import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]
