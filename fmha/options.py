"""The public options of attention, defined once.

``parse`` is the one definition of the mask, score and scale keywords every entry point takes
(their names, defaults and checks); ``AttentionOptions`` is what it returns, normalized and
hashable. From them follow the entry points' keyword lists (``with_public_options`` gives a
function taking ``**options`` the signature ``help()`` and ``inspect`` show), validation (which
takes an ``AttentionOptions``), the dispatch memo's key, and the custom ops' schema
(``OP_SCHEMA`` / ``op_args`` / ``from_op_args``). A new public option is added here, once.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from . import mods
from .masking import MaskKind, MaskSpec

__all__ = ["AttentionOptions", "parse", "parse_cached", "with_public_options", "OP_SCHEMA", "op_args",
           "from_op_args"]


@dataclass(frozen=True)
class AttentionOptions:
    """What a call computes besides its tensors: the mask, the scores' scale and softcap, and the
    fp8 dequantization scales (docs/semantics.md)."""

    # no defaults: ``parse`` holds them, and Dynamo (torch 2.11) cannot trace a dataclass whose
    # field defaults to an instance
    mask: MaskSpec
    #: None: 1 / sqrt(D), resolved against q's head dim by validation
    softmax_scale: Optional[float]
    softcap: float
    scale_q: float
    scale_k: float
    scale_v: float
    inv_scale_o: float
    #: programmable attention (``fmha.mods``): the score's and the mask's functions, or None
    score_mod: Optional[mods.ModFunction]
    mask_mod: Optional[mods.ModFunction]


def check_scale(name: str, value, allow_none: bool = False) -> Optional[float]:
    """A finite Python number (a tensor scale would need a host sync per call)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a Python float, got {type(value).__name__}"
            + (" (use .item() on the host)" if isinstance(value, torch.Tensor) else "")
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_softcap(softcap) -> float:
    """softcap: 0 (none) or a positive finite number."""
    softcap = check_scale("softcap", softcap)
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 turns it off), got {softcap}")
    return softcap


def parse(
    causal=False,
    window_size=(None, None),
    mask_align="top_left",
    compressed_causal=False,
    softmax_scale=None,
    softcap=0.0,
    scale_q=1.0,
    scale_k=1.0,
    scale_v=1.0,
    inv_scale_o=1.0,
    score_mod=None,
    mask_mod=None,
) -> AttentionOptions:
    """The public keywords, checked; TypeError/ValueError say what to change.

    ``causal``: keys at or before the diagonal. ``window_size=(left, right)``: sides are ints or
    None (unbounded) and may be negative (band offsets, FlashAttention-4's convention);
    ``causal=True`` with a window clips its right side to 0. ``mask_align``: "top_left" or
    "bottom_right" (the diagonal through the last query and key). ``compressed_causal``: NSA's
    compression branch, True (block = stride = S_q // S_k) or ``(block, stride)``.
    ``softmax_scale``: the scores' scale (default 1 / sqrt(D)). ``softcap`` > 0: scores become
    ``softcap * tanh(s / softcap)``. ``scale_q/k/v``, ``inv_scale_o``: fp8 dequantization and
    output scales. ``score_mod(score, b, h, q_idx, kv_idx[, aux])`` modifies each scaled score,
    ``mask_mod(b, h, q_idx, kv_idx[, aux])`` keeps a key where it is true (``fmha.mods``).
    """
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    mask = MaskSpec.from_args(causal, window_size, mask_align, compressed_causal)
    score_mod = mods.ModFunction.check(score_mod, mods.SCORE)
    mask_mod = mods.ModFunction.check(mask_mod, mods.MASK)
    softcap = check_softcap(softcap)
    if score_mod is not None and softcap:
        raise ValueError("softcap and score_mod together: write the cap in score_mod "
                         "(cap * fmha.mods.tanh(score / cap)) and leave softcap at 0")
    return AttentionOptions(
        mask=mask,
        softmax_scale=check_scale("softmax_scale", softmax_scale, allow_none=True),
        softcap=softcap,
        scale_q=check_scale("scale_q", scale_q),
        scale_k=check_scale("scale_k", scale_k),
        scale_v=check_scale("scale_v", scale_v),
        inv_scale_o=check_scale("inv_scale_o", inv_scale_o),
        score_mod=score_mod,
        mask_mod=mask_mod,
    )


#: the public keywords, in order, with their defaults
PUBLIC_KEYWORDS = tuple(inspect.signature(parse).parameters.values())


def _typed(value):
    """A memo key part: True and 1 are equal keys, but only one may be valid."""
    if type(value) is tuple:
        return tuple(_typed(v) for v in value)
    return value, type(value)


@functools.lru_cache(maxsize=512)
def _parse_key(key) -> AttentionOptions:
    return parse(**{name: value for name, (value, _) in key})


def parse_cached(**options) -> AttentionOptions:
    """``parse``, remembered for hashable keywords: a loop that repeats its call pays for the
    checks once. Under torch.compile the plain ``parse`` runs (traced once; some torch versions'
    Dynamo cannot trace ``hash``)."""
    if torch.compiler.is_compiling():
        return parse(**options)
    try:
        key = tuple((name, (value, _typed(value))) for name, value in sorted(options.items()))
        hash(key)
    except TypeError:  # a list window, a tensor scale...: the full checks report or accept them
        return parse(**options)
    try:
        return _parse_key(key)
    except TypeError as e:
        if "unexpected keyword" in str(e):
            raise TypeError(f"unknown option {str(e).split('argument')[-1].strip()}; the options are "
                            + ", ".join(p.name for p in PUBLIC_KEYWORDS)) from None
        raise


def with_public_options(fn):
    """Give ``fn(..., **options)`` the signature that lists the public keywords in place of
    ``**options`` (what ``help()`` and ``inspect.signature`` show)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    at = next((i for i, p in enumerate(params) if p.kind == inspect.Parameter.KEYWORD_ONLY), len(params))
    options = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in PUBLIC_KEYWORDS]
    fn.__signature__ = sig.replace(parameters=params[:at] + options + params[at:])
    return fn


# ---- the custom ops' view: a flat list of schema-typed values

#: (name, schema type) of the options in the custom ops' schema
OP_FIELDS = (
    ("mask_kind", "int"), ("window_left", "int?"), ("window_right", "int?"), ("bottom_right", "bool"),
    ("compress_block", "int?"), ("compress_stride", "int?"), ("softmax_scale", "float?"), ("softcap", "float"),
    ("scale_q", "float"), ("scale_k", "float"), ("scale_v", "float"), ("inv_scale_o", "float"),
    ("score_mod", "int?"), ("mask_mod", "int?"),
)
OP_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in OP_FIELDS)


def op_args(options: AttentionOptions) -> tuple:
    m = options.mask
    block, stride = m.compression if m.compression is not None else (None, None)
    return (int(m.kind), m.window_left, m.window_right, m.bottom_right, block, stride, options.softmax_scale,
            options.softcap, options.scale_q, options.scale_k, options.scale_v, options.inv_scale_o,
            mods.register(options.score_mod), mods.register(options.mask_mod))


def from_op_args(values) -> AttentionOptions:
    (kind, left, right, bottom_right, block, stride, softmax_scale, softcap, scale_q, scale_k, scale_v,
     inv_scale_o, score_mod, mask_mod) = values
    mask = MaskSpec(MaskKind(kind), left, right, bottom_right, None if block is None else (block, stride))
    return AttentionOptions(mask, softmax_scale, softcap, scale_q, scale_k, scale_v, inv_scale_o,
                            mods.lookup(score_mod), mods.lookup(mask_mod))
