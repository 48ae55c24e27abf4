"""FlashAttention's argument conventions, turned into fmha's.

FlashAttention-4 (``flash_attn.cute``, checked against the 4.0.0b36 wheel) and
FlashAttention-3 (``hopper/flash_attn_interface.py``) differ from fmha in a few conventions:
masks are always aligned to the bottom right, a window side is spelled differently, inputs with
unaligned strides are copied instead of refused, and the LSE comes back in more cases. This
module holds those rules, and the list of FlashAttention features fmha does not have, which
are refused with ``NotImplementedError`` before anything runs.
"""

from __future__ import annotations

import operator
from typing import Iterable, Optional, Tuple

import torch

#: dtypes FlashAttention-4 takes for ``learnable_sink``
SINK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

Window = Tuple[Optional[int], Optional[int]]


def refuse_unsupported(features: Iterable[Tuple[str, bool, str]]) -> None:
    """Raise ``NotImplementedError`` for the first feature used: ``(argument, used, what it is)``."""
    for name, used, what in features:
        if used:
            raise NotImplementedError(
                f"fmha.flash_attn does not support {name} ({what}); leave {name} at its default, "
                "or call FlashAttention itself for this feature"
            )


def _window_side(name: str, side) -> Optional[int]:
    if side is None:
        return None
    if isinstance(side, bool):
        raise ValueError(f"window_size {name} must be an int or None, got {side!r}")
    try:
        return operator.index(side)
    except TypeError:
        raise ValueError(f"window_size {name} must be an int or None, got {side!r}") from None


def _window_pair(window_size) -> Window:
    if window_size is None:
        return None, None
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}") from None
    return _window_side("left", left), _window_side("right", right)


def window_fa4(causal, window_size) -> Window:
    """FlashAttention-4's window, as fmha's ``window_size`` with ``causal=False`` and bottom-right
    alignment. None is unbounded and a negative side is a band offset, as in fmha; only a pair
    whose sides are both negative means "no window" (FlashAttention-2's ``(-1, -1)``); ``causal``
    then sets the right side to 0 (it replaces the window's right side, it does not clip it)."""
    left, right = _window_pair(window_size)
    if left is not None and right is not None and left < 0 and right < 0:
        left, right = None, None
    if causal:
        right = 0
    return left, right


def window_fa3(causal, window_size) -> Window:
    """FlashAttention-3's window (``flash_attn_with_kvcache``): a negative side (its default
    ``(-1, -1)``) or None is unbounded on that side; ``causal`` sets the right side to 0."""
    left, right = _window_pair(window_size)
    left = None if left is None or left < 0 else left
    right = None if right is None or right < 0 else right
    if causal:
        right = 0
    return left, right


def check_learnable_sink(sink, num_heads_q: int) -> None:
    """FlashAttention-4's rule for ``learnable_sink``: (H_q,) in fp16, bf16 or fp32."""
    if sink is None:
        return
    if not isinstance(sink, torch.Tensor):
        raise TypeError(f"learnable_sink must be a torch.Tensor, got {type(sink).__name__}")
    if sink.dtype not in SINK_DTYPES:
        raise TypeError(f"learnable_sink must be float16, bfloat16 or float32, got {str(sink.dtype)[6:]}")
    if tuple(sink.shape) != (num_heads_q,):
        raise ValueError(f"learnable_sink must have one logit per query head, shape ({num_heads_q},), "
                         f"got {tuple(sink.shape)}")


def needs_grad(*tensors) -> bool:
    """Whether autograd will record the call (FlashAttention then also returns the LSE)."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def wants_lse(return_lse: bool, *inputs) -> bool:
    """FlashAttention-4 computes the LSE when asked, and whenever an input requires grad."""
    return bool(return_lse) or any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def lse_for_caller(lse: Optional[torch.Tensor], return_lse: bool) -> Optional[torch.Tensor]:
    """The LSE as FlashAttention-4 hands it back: differentiable only when ``return_lse`` (it
    ignores the LSE's gradient otherwise)."""
    if lse is None or return_lse:
        return lse
    return lse.detach()
