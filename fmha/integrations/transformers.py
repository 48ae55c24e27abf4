"""``attn_implementation="fmha"`` for Hugging Face transformers models.

    import fmha.integrations.transformers
    fmha.integrations.transformers.register()       # once; imports transformers
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fmha")
    # or model.set_attn_implementation("fmha")

``register()`` adds two functions to transformers' registries under "fmha": ``attention_forward``
(``AttentionInterface``), which every attention layer written against that interface calls, and
``build_mask`` (``AttentionMaskInterface``), which builds the mask those layers get.

The mask function recognises transformers' own mask patterns and returns them in forms fmha
runs exactly: causal or bidirectional attention, a causal sliding window, with or without a 2-D
padding mask, packed sequences (``position_ids`` restarting inside a row); any cache (dynamic,
sliding, static). It returns

* None: no padding; the layer runs one dense fmha call (causal masks bottom-right aligned: the
  queries are the last positions of the keys);
* a (B, N) bool tensor: which positions 0 .. N - 1 are real tokens (False: padding, or a static
  cache's unused slots), N the end of the layer's keys; each layer takes the columns of its own
  keys (the last ones, for a sliding-window cache), unpads queries and keys to packed sequences
  (``cu_seqlens``), as transformers' FlashAttention integration does, and pads the output back
  (padded query rows are 0);
* a 1-D int32 tensor: the ``cu_seqlens`` of a packed batch, its rows flattened;
* anything else (chunked attention, image-token or other custom mask functions, a sliding window
  over padding that is not all on one side of the real tokens, a 4-D mask the caller made): the
  exact 4-D boolean mask transformers' SDPA path would use, and the layer computes attention with
  it in PyTorch (SDPA, or the scores spelled out where softcapping or sinks are needed): exact,
  not fast.

The attention function maps the layer's arguments onto fmha's: ``scaling`` (softmax scale),
``sliding_window`` (a causal window of that many keys, the row's own included, as transformers'
masks define it: fmha's ``window_size=(sliding_window - 1, 0)``), ``softcap`` (Gemma 2),
``s_aux`` (gpt-oss's per-head sinks), ``is_causal``, GQA (H_q a multiple of H_k, no repeat),
and FlashAttention-style ``cu_seq_lens_q/k`` + ``max_length_q/k`` keywords of a packed batch.
fmha has no attention dropout: a training layer with ``dropout > 0`` raises.

Importing this module does not import transformers; ``register()`` does.
"""

from __future__ import annotations

import collections
import logging
import weakref
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn.functional as F

import fmha

__all__ = ["IMPL_NAME", "register", "attention_forward", "build_mask", "attention_paths"]

#: the ``attn_implementation`` name
IMPL_NAME = "fmha"

logger = logging.getLogger("fmha")

# "dense" / "varlen" (fmha served the layer call) / "exact" (the 4-D mask fallback) -> calls
_PATHS: collections.Counter = collections.Counter()

# transformers.masking_utils and the code objects of its mask factories' closures, set by register()
_masking = None
_FACTORY_CODE: Dict[str, object] = {}

_INEXPRESSIBLE = object()  # a mask pattern fmha's masks cannot state exactly


def register() -> None:
    """Register fmha's attention and mask functions with transformers under ``IMPL_NAME``.
    Idempotent."""
    global _masking
    try:
        from transformers import AttentionInterface
        from transformers import masking_utils
    except ImportError as e:
        raise ImportError("fmha.integrations.transformers.register() needs Hugging Face transformers "
                          "(verified with 5.17.0 and 5.24.0): pip install transformers") from e
    _masking = masking_utils
    # the closures transformers builds its masks from, told apart by their code objects
    _FACTORY_CODE.update(
        and_masks=masking_utils.and_masks(masking_utils.causal_mask_function).__code__,
        sliding_window_overlay=masking_utils.sliding_window_overlay(1).__code__,
        packed_sequence=masking_utils.packed_sequence_mask_function(None).__code__,
    )
    # newer transformers (5.24) remap a packed row's positions to each sequence's own; older
    # ones (5.17) have no such function and apply the base pattern to the row's positions
    remap = getattr(masking_utils, "remap_positions_for_packed_sequence", None)
    _FACTORY_CODE["remap_positions"] = (remap(masking_utils.causal_mask_function, None).__code__
                                        if remap is not None else None)
    AttentionInterface.register(IMPL_NAME, attention_forward)
    masking_utils.AttentionMaskInterface.register(IMPL_NAME, build_mask)


def attention_paths() -> Dict[str, int]:
    """How many attention-layer calls took each path since the process started: "dense" and
    "varlen" (fmha), "exact" (the 4-D mask computed in PyTorch)."""
    return dict(_PATHS)


# -- the mask ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    """A mask pattern of transformers' that fmha states exactly."""

    causal: bool
    window: Optional[int] = None  # causal sliding window: keys a row sees, its own included
    packed_ids: Optional[torch.Tensor] = None  # (B, S) sequence index of each token of a packed batch


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    if code is None or not fn.__closure__:
        return {}
    return dict(zip(code.co_freevars, (cell.cell_contents for cell in fn.__closure__)))


def _pattern(mask_function) -> Optional[_Pattern]:
    """The pattern of one of transformers' mask functions, or None when it is not one fmha
    states exactly (then the exact 4-D mask is used: never a wrong result)."""
    m = _masking
    if mask_function is m.causal_mask_function:
        return _Pattern(causal=True)
    if mask_function is m.bidirectional_mask_function:
        return _Pattern(causal=False)
    if getattr(mask_function, "__code__", None) is not _FACTORY_CODE["and_masks"]:
        return None
    parts = _closure(mask_function).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2:
        return None
    first, second = parts
    first_code, second_code = getattr(first, "__code__", None), getattr(second, "__code__", None)
    if first_code is _FACTORY_CODE["sliding_window_overlay"] and second is m.causal_mask_function:
        window = _closure(first).get("sliding_window")
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            return _Pattern(causal=True, window=window)
        return None
    if second_code is _FACTORY_CODE["packed_sequence"]:
        # a packed row: keys of the query's own sequence only, and the base pattern either on
        # positions that count up by one inside each sequence (remapped: transformers 5.24) or
        # on the row's own positions (transformers 5.17); a causal pattern, windowed or not,
        # depends only on distances inside one sequence, so either is, per sequence, the base
        # pattern on indices
        remap = _FACTORY_CODE.get("remap_positions")
        base = _pattern(_closure(first).get("mask_function") if remap is not None and first_code is remap else first)
        ids = _closure(second).get("packed_sequence_mask")
        if base is not None and base.causal and base.packed_ids is None and isinstance(ids, torch.Tensor):
            return _Pattern(causal=True, window=base.window, packed_ids=ids)
    return None


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask: Optional[torch.Tensor] = None, device="cpu", **kwargs):
    """transformers' ``AttentionMaskInterface`` entry for "fmha" (module docstring: what it
    returns). ``attention_mask`` is the 2-D padding mask over absolute positions, if any."""
    if mask_function is None:
        mask_function = _masking.causal_mask_function
    pattern = _pattern(mask_function)
    if pattern is not None:
        if pattern.packed_ids is not None:
            return _packed_offsets(pattern.packed_ids)
        valid = _key_validity(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, device)
        if valid is not _INEXPRESSIBLE:
            return valid
    return _masking.sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, local_size=kwargs.get("local_size"),
        allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=kwargs.get("use_vmap", False),
        device=device)


def _key_validity(pattern: _Pattern, batch_size, q_length, kv_length, q_offset, kv_offset, padding, device):
    """None, or (B, N) bool: which of the positions 0 .. N - 1 are real tokens, N the end of the
    layer's keys; or _INEXPRESSIBLE.

    Positions are absolute, as in transformers' own 2-D masks, so that a model which builds its
    masks again from this one (generate() passes a static cache's masks back in) gets it again.
    A layer's keys are the positions kv_offset .. kv_offset + S_k - 1 (``_layer_columns``)."""
    q_offset, kv_offset = int(q_offset), int(kv_offset)  # a static cache's q_offset is a tensor: one read here
    if pattern.causal:
        # a causal row never sees keys past the last query: those (a static cache's unused
        # slots) are cut, and the queries are then the last positions of the keys
        end = q_offset + q_length
        if q_offset < kv_offset or end > kv_offset + kv_length:
            return _INEXPRESSIBLE
    else:
        end = kv_offset + kv_length
    if padding is None:
        if end == kv_offset + kv_length:
            return None
        return torch.ones(batch_size, end, dtype=torch.bool, device=device)
    if padding.dim() != 2:
        return _INEXPRESSIBLE
    padding = padding.to(device=device, dtype=torch.bool)
    if padding.shape[0] != batch_size:
        padding = padding.expand(batch_size, -1)
    if padding.shape[1] < end:  # positions past the 2-D mask are not tokens (a static cache's tail)
        padding = F.pad(padding, (0, end - padding.shape[1]), value=False)
    valid = padding[:, :end]
    keys = valid[:, kv_offset:]
    # unpadding shifts the keys left past padding between real tokens; a window counted in
    # positions then is not one counted in keys
    if pattern.window is not None and not _one_run_per_row(keys):
        return _INEXPRESSIBLE
    if end == kv_offset + kv_length and bool(keys.all()):
        return None
    return valid


def _layer_columns(valid: torch.Tensor, num_keys: int):
    """(the columns of an absolute (B, N) validity mask that are the layer's keys, how many of
    the layer's keys they cover). A layer holding fewer than N keys holds the last ones (a sliding
    window's cache); one holding more holds positions 0 .. N - 1 first (a static cache, whose
    slots past N are unused)."""
    n = valid.shape[1]
    if num_keys >= n:
        return valid, n
    return valid[:, n - num_keys:], num_keys


def _one_run_per_row(valid: torch.Tensor) -> bool:
    """Whether the True entries of each row of ``valid`` (B, L) are consecutive."""
    index = torch.arange(valid.shape[1], device=valid.device)
    first = torch.where(valid, index, valid.shape[1]).amin(1)
    last = torch.where(valid, index, -1).amax(1)
    count = valid.sum(1)
    return bool(((count == 0) | (last - first + 1 == count)).all())


def _packed_offsets(ids: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int32) of the flattened rows of a packed batch: a sequence starts at each
    row's start and wherever the sequence index changes."""
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    begin = starts.flatten().nonzero().flatten()
    return torch.cat([begin, begin.new_full((1,), ids.numel())]).to(torch.int32)


# -- the attention ----------------------------------------------------------------------------------


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      is_causal: Optional[bool] = None, s_aux: Optional[torch.Tensor] = None, **kwargs):
    """transformers' ``AttentionInterface`` entry for "fmha": query (B, H_q, S_q, D), key/value
    (B, H_k, S_k, D) -> (attention output (B, S_q, H_q, D_v), None)."""
    if kwargs.get("output_attentions", False) and not _warned.get("output_attentions"):
        _warned["output_attentions"] = True
        logger.warning("fmha: attn_implementation='fmha' returns no attention weights (output_attentions=True); "
                       "use attn_implementation='eager' to get them")
    if dropout:
        raise ValueError(
            f"fmha has no attention dropout, and {type(module).__name__} asks for dropout={dropout} (a training "
            "model whose config has attention_dropout > 0): set config.attention_dropout = 0.0, or train with "
            "attn_implementation='sdpa'")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    options = dict(softmax_scale=scaling, softcap=float(softcap or 0.0), sinks=s_aux,
                   window_size=_window(is_causal, sliding_window))
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views, fmha's layout
    if attention_mask is None:
        offsets = _packed_offsets_from_kwargs(kwargs)
        if offsets is None:
            _PATHS["dense"] += 1
            return fmha.attention(q, k, v, causal=is_causal, mask_align="bottom_right", **options), None
        return _packed(q, k, v, *offsets, is_causal, options), None
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attn_implementation='fmha' takes a tensor attention mask, got "
                        f"{type(attention_mask).__name__} (a mask made for another attention implementation?)")
    if attention_mask.dim() == 4:
        _PATHS["exact"] += 1
        return _exact(module, query, key, value, attention_mask, scaling, softcap, s_aux), None
    if attention_mask.dim() == 2:
        return _unpadded(q, k, v, attention_mask, is_causal, options), None
    if attention_mask.dim() == 1:  # this module's mask function's form of a packed batch
        return _packed(q, k, v, attention_mask, None, None, None, is_causal, options), None
    raise ValueError(f"attention mask of shape {tuple(attention_mask.shape)}: attn_implementation='fmha' takes "
                     "a 2-D padding mask, a 4-D mask, or the masks of fmha.integrations.transformers.build_mask")


_warned: Dict[str, bool] = {}


def _window(is_causal: bool, sliding_window: Optional[int]):
    """fmha's window_size for a layer's ``sliding_window``: transformers' causal window keeps the
    row's own key and the ``sliding_window - 1`` before it; its bidirectional one keeps keys at
    distance at most ``sliding_window``."""
    if sliding_window is None:
        return (None, None)
    if is_causal:
        return (sliding_window - 1, 0)
    return (sliding_window, sliding_window)


def _packed_offsets_from_kwargs(kwargs):
    """(cu_seqlens_q, cu_seqlens_k, max_q, max_k) from FlashAttention-style keywords, or None."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if any(kwargs.get(n) is None for n in names):
        return None
    cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
    return cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[2:])


def _packed(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, options):
    """Rows of packed sequences, flattened: one varlen fmha call."""
    batch, s_q = q.shape[:2]
    if cu_k is None:  # from the mask function: queries and keys are the same tokens
        if k.shape[1] != s_q:
            raise ValueError(f"a packed batch needs as many keys as queries per row, got {k.shape[1]} and {s_q}")
        cu_k = cu_q
    _PATHS["varlen"] += 1
    out = fmha.attention_varlen(_flat(q), _flat(k), _flat(v), cu_q, cu_k, max_q, max_k, causal=is_causal,
                                mask_align="bottom_right", **options)
    return out.view(batch, s_q, *out.shape[1:])


@dataclass(frozen=True)
class _Unpadding:
    """How one (B, L) key-validity mask unpads a layer's queries and keys (shared by its layers)."""

    length: int
    all_valid: bool
    q_index: Optional[torch.Tensor] = None
    k_index: Optional[torch.Tensor] = None
    cu_q: Optional[torch.Tensor] = None
    cu_k: Optional[torch.Tensor] = None
    max_q: int = 0
    max_k: int = 0


# id(mask) -> (weak reference, version, (q_length, keys, causal), _Unpadding): every layer of a
# forward gets the same mask tensor, so its indices and offsets are computed (and read back) once
_UNPADDINGS: dict = {}
_UNPADDINGS_LIMIT = 8


def _unpadding(valid: torch.Tensor, q_length: int, num_keys: int, causal: bool) -> _Unpadding:
    if torch.compiler.is_compiling():  # traced: no Python-side memo
        return _make_unpadding(valid, q_length, num_keys, causal)
    try:
        version = valid._version
    except RuntimeError:  # an inference tensor has no version counter: not kept
        return _make_unpadding(valid, q_length, num_keys, causal)
    use = (q_length, num_keys, causal)
    seen = _UNPADDINGS.get(id(valid))
    if seen is not None and seen[0]() is valid and seen[1] == version and seen[2] == use:
        return seen[3]
    plan = _make_unpadding(valid, q_length, num_keys, causal)
    if len(_UNPADDINGS) >= _UNPADDINGS_LIMIT:
        _UNPADDINGS.clear()
    _UNPADDINGS[id(valid)] = (weakref.ref(valid), version, use, plan)
    return plan


def _make_unpadding(valid: torch.Tensor, q_length: int, num_keys: int, causal: bool) -> _Unpadding:
    if valid.dtype != torch.bool:
        valid = valid != 0
    valid, length = _layer_columns(valid, num_keys)
    batch = valid.shape[0]
    k_counts = valid.sum(1, dtype=torch.int32)
    # a causal layer's queries are the last q_length keys (FlashAttention's reading of a 2-D
    # mask), so padded query rows drop out; a bidirectional layer keeps every query row
    q_valid = valid[:, length - q_length:] if causal else torch.ones(batch, q_length, dtype=torch.bool,
                                                                        device=valid.device)
    q_counts = q_valid.sum(1, dtype=torch.int32)
    min_k, max_k, max_q = torch.stack([k_counts.amin(), k_counts.amax(), q_counts.amax()]).tolist()  # one sync
    if min_k == length:
        return _Unpadding(length, all_valid=True)

    def offsets(counts):
        return F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))

    return _Unpadding(length, all_valid=False, q_index=q_valid.flatten().nonzero().flatten(),
                      k_index=valid.flatten().nonzero().flatten(), cu_q=offsets(q_counts), cu_k=offsets(k_counts),
                      max_q=max_q, max_k=max_k)


def _unpadded(q, k, v, valid, is_causal, options):
    """A batch with padding (2-D mask of positions 0 .. N - 1): unpad, one varlen fmha call, pad
    back."""
    batch, s_q, heads = q.shape[:3]
    if valid.shape[0] != batch or s_q > min(valid.shape[1], k.shape[1]):
        raise ValueError(f"a 2-D attention mask of shape {tuple(valid.shape)} does not fit queries of shape "
                         f"{tuple(q.shape)} and keys of shape {tuple(k.shape)} (B, S, H, D): it must be "
                         "(B, N) with N >= S_q, the last S_q positions the queries'")
    plan = _unpadding(valid, s_q, k.shape[1], is_causal)
    k, v = k[:, :plan.length], v[:, :plan.length]
    if plan.all_valid:
        _PATHS["dense"] += 1
        return fmha.attention(q, k, v, causal=is_causal, mask_align="bottom_right", **options)
    _PATHS["varlen"] += 1
    out = fmha.attention_varlen(_flat(q)[plan.q_index], _flat(k)[plan.k_index], _flat(v)[plan.k_index],
                                plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, causal=is_causal,
                                mask_align="bottom_right", **options)
    padded = out.new_zeros(batch * s_q, heads, out.shape[-1]).index_copy(0, plan.q_index, out)
    return padded.view(batch, s_q, heads, out.shape[-1])


def _exact(module, query, key, value, mask, scaling, softcap, sinks):
    """Attention with an arbitrary 4-D mask (bool: True keeps; float: added to the scores), in
    PyTorch: SDPA, or the scores spelled out in fp32 where softcapping or sinks are needed."""
    heads_q, heads_k = query.shape[1], key.shape[1]
    if not softcap and sinks is None:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                             enable_gqa=heads_q != heads_k)
        return out.transpose(1, 2)
    group = heads_q // heads_k
    k = key.float().repeat_interleave(group, 1)
    v = value.float().repeat_interleave(group, 1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = (query.float() @ k.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    lowest = torch.finfo(scores.dtype).min  # not -inf: a row that keeps nothing stays finite, as in eager
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, lowest)
    else:
        scores = (scores + mask.float()).clamp_min(lowest)
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ v).to(query.dtype).transpose(1, 2)
