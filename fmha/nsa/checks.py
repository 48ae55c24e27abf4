"""Argument checks of ``fmha.nsa``: each failure names the argument and says what to change.
``TypeError`` for a value of the wrong kind, ``ValueError`` for a right kind that is wrong, as in
``fmha.validation``. Checks that read a tensor's values (offsets, ``selected=``) copy them to the
host, which waits for the GPU; they are skipped while torch.compile traces (the ops re-check
offsets when they run)."""

from __future__ import annotations

import math
import numbers
from typing import List, Optional

import torch

from ..validation import device_mismatch_message
from .layout import num_compressed_blocks, num_selection_blocks, token_positions

__all__ = [
    "INPUT_DTYPES",
    "check_int",
    "check_geometry",
    "check_qkv",
    "check_scale",
    "check_like_q",
    "read_seqlens",
    "check_compressed_offsets",
    "check_offsets_tensor",
    "check_compressed_kv",
    "check_selected",
]

#: what the NSA branches take (fp8 has no NSA path)
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _same_device(name: str, t: torch.Tensor, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(device_mismatch_message(name, t.device, q.device))


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def check_geometry(block, stride, select_block=None, select_count=None, window=None) -> None:
    """The block sizes: 1 <= stride <= block (a larger stride would leave tokens out of every
    compressed block), select_block, select_count and window at least 1."""
    check_int("block", block)
    check_int("stride", stride)
    if stride > block:
        raise ValueError(f"stride ({stride}) must not exceed block ({block}): tokens between blocks would be "
                         "dropped; use stride <= block (the paper: block=32, stride=16)")
    for name, value in (("select_block", select_block), ("select_count", select_count), ("window", window)):
        if value is not None:
            check_int(name, value)


def check_qkv(q, k, v, packed: bool, names=("q", "k", "v"), same_tokens: bool = True) -> None:
    """q (T, H_q, D) / k (T, H_k, D) / v (T, H_k, D_v) packed, or with a leading batch dim;
    ``same_tokens=False`` lets k/v have their own token count (compressed keys)."""
    nq, nk, nv = names
    for name, t in zip(names, (q, k, v)):
        _tensor(name, t)
    if q.dtype not in INPUT_DTYPES:
        raise TypeError(f"{nq} is {_name(q.dtype)}; NSA takes float16, bfloat16, float32 or float64 "
                        "(convert with .to(torch.bfloat16))")
    for name, t in ((nk, k), (nv, v)):
        if t.dtype != q.dtype:
            raise TypeError(f"dtype mismatch: {nq} is {_name(q.dtype)} but {name} is {_name(t.dtype)}; "
                            f"they must have the same dtype")
        _same_device(name, t, q)
    rank = 3 if packed else 4
    layout = "(T, H, D) with cu_seqlens" if packed else "(B, S, H, D) (or (T, H, D) with cu_seqlens)"
    for name, t in zip(names, (q, k, v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}")
    tokens = slice(None, -2) if same_tokens else slice(None, -3)
    if q.shape[tokens] != k.shape[tokens] or k.shape[:-1] != v.shape[:-1]:
        what = "token dims (NSA is self-attention)" if same_tokens else "batch dims"
        raise ValueError(f"{nq} {tuple(q.shape)}, {nk} {tuple(k.shape)} and {nv} {tuple(v.shape)} must share their "
                         f"{what}, and {nk} and {nv} their rows and heads")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{nq} has head dim {q.shape[-1]} but {nk} has {k.shape[-1]}; they must match")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0 or hq % hk:
        raise ValueError(f"H_q={hq} is not a multiple of H_k={hk}: grouped-query attention needs H_q % H_k == 0")


def check_scale(softmax_scale, head_dim: int) -> float:
    """The score scale: 1/sqrt(D) by default, else a positive Python number."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a Python float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be positive and finite, got {softmax_scale}")
    return float(softmax_scale)


def check_like_q(name: str, t, q: torch.Tensor, shape: tuple, what: str) -> None:
    """A float tensor on q's device of exactly ``shape`` (gates, gradients...)."""
    _tensor(name, t)
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {_name(t.dtype)}")
    _same_device(name, t, q)
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(t.shape)}")


def check_offsets_tensor(name: str, cu, device: torch.device) -> None:
    """``cu`` is offsets by its metadata: an int32 tensor on ``device``, 1-D of length B + 1
    (nothing is read)."""
    _tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_name(cu.dtype)}; use .to(torch.int32)")
    if cu.device != device:
        raise ValueError(device_mismatch_message(name, cu.device, device))
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length B + 1, got shape {tuple(cu.shape)}")


def read_seqlens(name: str, cu, total: int, device: torch.device) -> List[int]:
    """The sequence lengths of offsets ``cu`` (int32, B + 1, starting at 0, never decreasing,
    ending at ``total``), read on the host."""
    check_offsets_tensor(name, cu, device)
    offsets = cu.tolist()  # host sync
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lens = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"{name} must be nondecreasing: {name}[{i + 1}] = {offsets[i + 1]} < "
                             f"{name}[{i}] = {offsets[i]}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1] = {offsets[-1]} but the tensors have {total} rows; the last offset must "
                         "equal the number of packed tokens")
    return lens


def check_compressed_offsets(cu, cu_cmp, rows: int, rows_cmp: int, block: int, stride: int,
                             device: torch.device) -> Optional[List[int]]:
    """The offsets of packed queries and of their compressed keys agree: sequence b of length n
    has max(0, (n - block) // stride + 1) compressed rows. Returns the lengths (None while
    torch.compile traces: nothing is read then)."""
    if torch.compiler.is_compiling():
        return None
    lens = read_seqlens("cu_seqlens", cu, rows, device)
    lens_cmp = read_seqlens("cu_seqlens_cmp", cu_cmp, rows_cmp, device)
    want = [num_compressed_blocks(n, block, stride) for n in lens]
    if lens_cmp != want:
        raise ValueError(f"cu_seqlens_cmp gives compressed lengths {lens_cmp[:8]}, but sequences of lengths "
                         f"{lens[:8]} have {want[:8]} blocks of block={block}, stride={stride}; build it with "
                         "fmha.nsa.compressed_cu_seqlens(cu_seqlens, block, stride)")
    return lens


def check_compressed_kv(k_cmp, v_cmp, k: torch.Tensor, v: torch.Tensor, rows: int, block: int,
                        stride: int) -> None:
    """k_cmp (rows, H_k, D) and v_cmp (rows, H_k, D_v) in k's dtype and device, ``rows`` being the
    compressed blocks that ``block``/``stride`` give (with a leading batch dim when dense)."""
    for name, t, like in (("k_cmp", k_cmp, k), ("v_cmp", v_cmp, v)):
        _tensor(name, t)
        if t.dtype != like.dtype:
            raise TypeError(f"{name} is {_name(t.dtype)} but k/v are {_name(like.dtype)}; pool in their dtype")
        _same_device(name, t, k)
        want = tuple(like.shape[:-3]) + (rows,) + tuple(like.shape[-2:])
        if tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {want}: {rows} compressed blocks of block={block}, "
                             f"stride={stride} (fmha.nsa.mean_pool's layout), got {tuple(t.shape)}")


def check_selected(selected, k: torch.Tensor, cu_seqlens: Optional[torch.Tensor], select_block: int,
                   read_values: bool = True) -> torch.Tensor:
    """``selected`` (T, H_k, n) with ``cu_seqlens``, or (B, S, H_k, n), int32/int64: selection
    block indices in each query's own sequence, -1 for an unused slot, no index twice in a list
    (the values are read on the host unless ``read_values`` is False). Returns it as int32."""
    _tensor("selected", selected)
    if selected.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"selected must be int32 (or int64), got {_name(selected.dtype)}")
    _same_device("selected", selected, k)
    want = tuple(k.shape[:-1])
    if selected.dim() != len(want) + 1 or tuple(selected.shape[:-1]) != want or selected.shape[-1] < 1:
        raise ValueError(f"selected must have shape {want + ('n',)} (tokens, H_k, n >= 1), got "
                         f"{tuple(selected.shape)}")
    if torch.compiler.is_compiling() or not read_values:
        return selected.to(torch.int32)
    flat = selected.reshape(-1, selected.shape[-2], selected.shape[-1])
    if cu_seqlens is None:
        lengths = torch.full((flat.shape[0],), k.shape[1], device=k.device, dtype=torch.long)
    else:
        lengths = token_positions(cu_seqlens, flat.shape[0]).length
    limit = num_selection_blocks(lengths, select_block).view(-1, 1, 1)
    bad = (flat < -1) | (flat >= limit)
    if bool(bad.any()):
        row, head, slot = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"selected[{row}, {head}, {slot}] (packed token {row}) = {int(flat[row, head, slot])} is "
                         f"out of range: that token's sequence has {int(limit[row])} selection blocks of "
                         f"select_block={select_block}; use -1 for an unused slot")
    ordered = flat.sort(dim=-1).values
    twice = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(twice.any()):
        row, head, _ = (int(x) for x in twice.nonzero()[0])
        raise ValueError(f"selected (packed token {row}, KV head {head}) lists a block twice: "
                         f"{flat[row, head].tolist()}; each block may appear once per list")
    return selected.to(torch.int32)
