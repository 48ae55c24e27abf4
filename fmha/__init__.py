"""fmha: fused multi-head attention kernels (CuTe DSL) with an exact PyTorch reference."""

from .api import FusedAttention, attention, attention_backward, attention_varlen
from . import mods
from .backends import UnsupportedError
from .block_mask import BlockMask, create_block_mask
from .device_errors import check_device_errors
from .kvcache import attention_with_kvcache
from .masking import MaskKind, MaskSpec
from .reference import attention_reference

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_varlen",
    "attention_backward",
    "attention_with_kvcache",
    "FusedAttention",
    "UnsupportedError",
    "check_device_errors",
    "attention_reference",
    "MaskKind",
    "MaskSpec",
    "BlockMask",
    "create_block_mask",
    "mods",
]
