"""Staging of V for the fp8 kernel: the launcher, and a torch version of the same pass.

fp8 ``wgmma`` reads both shared-memory operands K-major. For O += P V the reduction runs over
keys, so V must arrive with keys contiguous: (B, H_k, D, S_pad) instead of the user's
(B, S_k, H_k, D). One pass over V on the GPU produces that layout; its cost (a read and a
write of V, in bytes of fp8) is included in every fp8 timing we report.

The same pass also reorders keys inside each block of 32. The fp8 A operand of the P.V product
wants, per thread, four consecutive keys of one row, while the S accumulator gives a thread two
adjacent keys out of every eight. Rather than exchanging bytes between threads, the kernel feeds
each thread's own P values to the A-operand slots (``as_operand_a_fp8``), and V's keys are
permuted here to match: slot ``j`` of a block holds key ``FP8_KEY_ORDER[j]`` of that block.

For varlen inputs each sequence is padded to its own batch row (S_pad = max_seqlen_k rounded up
to 32), so every sequence starts on a block boundary and the kernel indexes V by batch.

On the GPU the pass is one launch of ``v_transpose.StageVKernel``; ``stage_v_fp8_torch`` does the
same with torch ops (for CPU tensors, and as the reference the GPU check compares against).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from fmha.jit import disk_cache

from ..common.fp8_order import FP8_KEY_BLOCK as KEY_BLOCK


@functools.lru_cache(maxsize=16)
def _slot_keys(s_pad: int, device: torch.device) -> torch.Tensor:
    """Source key (within the sequence) of every staged slot 0 .. s_pad - 1.

    FP8_KEY_ORDER is a reordering of the key's bits within its block: slot 16 a + 4 t + 2 c + e
    holds key 16 a + 8 c + 2 t + e, i.e. keys viewed as (blocks, a, c, t, e) and read as
    (blocks, a, t, c, e)."""
    keys = torch.arange(s_pad, dtype=torch.int64, device=device)
    return _as_slots(keys.reshape(s_pad // KEY_BLOCK, 2, 2, 4, 2), a_dim=1).reshape(-1)


def _as_slots(keys: torch.Tensor, a_dim: int) -> torch.Tensor:
    """A view with a key's bits split as (a, c, t, e) from dim ``a_dim`` on, permuted to the
    slot order (a, t, c, e)."""
    order = list(range(keys.dim()))
    order[a_dim + 1], order[a_dim + 2] = a_dim + 2, a_dim + 1
    return keys.permute(order)


def staged_length(seqlen_k: int) -> int:
    return max(KEY_BLOCK, -(-seqlen_k // KEY_BLOCK) * KEY_BLOCK)


def stage_v_fp8(v: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor], max_seqlen_k: int) -> torch.Tensor:
    """(B, S_k, H_k, D) or varlen (T_k, H_k, D) fp8 -> contiguous (B, H_k, D, S_pad) with keys
    permuted per block of 32 and zeros past each sequence's end (masked keys must multiply
    finite values: P is 0 there, and 0 * NaN would not be)."""
    if not v.is_cuda or v.shape[0] == 0:
        return stage_v_fp8_torch(v, cu_seqlens_k, max_seqlen_k)
    varlen = cu_seqlens_k is not None
    d = v.shape[-1]
    batch = cu_seqlens_k.shape[0] - 1 if varlen else v.shape[0]
    heads = v.shape[-2]
    s_pad = staged_length(max_seqlen_k)
    staged = torch.empty((batch, heads, d, s_pad), dtype=torch.uint8, device=v.device)
    if staged.numel():
        _stage_kernel(d, varlen)(v.view(torch.uint8).view(torch.int32), staged.view(torch.int32),
                                 cu_seqlens_k if varlen else None)
    return staged.view(torch.float8_e4m3fn)


@functools.lru_cache(maxsize=None)
def _stage_kernel(head_dim: int, varlen: bool):
    from .v_transpose import compile_stage_v

    return disk_cache.load_or_compile(("stage_v_fp8", head_dim, varlen),
                                      lambda key: compile_stage_v(*key[1:]))


def stage_v_fp8_torch(v: torch.Tensor, cu_seqlens_k: Optional[torch.Tensor], max_seqlen_k: int) -> torch.Tensor:
    """``stage_v_fp8`` with torch ops: a strided copy (dense) or a gather (varlen)."""
    raw = v.view(torch.uint8)  # fp8 moves are byte moves
    s_pad = staged_length(max_seqlen_k)
    if cu_seqlens_k is None:
        b, s_k, h, d = raw.shape
        if s_pad != s_k:
            padded = raw.new_zeros((b, s_pad, h, d))
            padded[:, :s_k] = raw
            raw = padded
        # One strided view and one copy: (B, blocks, a, c, t, e, H, D) -> (B, H, D, blocks, a, t, c, e).
        slots = _as_slots(raw.reshape(b, s_pad // KEY_BLOCK, 2, 2, 4, 2, h, d), a_dim=2)
        staged = slots.permute(0, 6, 7, 1, 2, 3, 4, 5).reshape(b, h, d, s_pad)
        return staged.contiguous().view(torch.float8_e4m3fn)
    src = _slot_keys(s_pad, v.device)
    t, h, d = raw.shape
    starts = cu_seqlens_k[:-1].to(torch.int64)
    lens = cu_seqlens_k[1:].to(torch.int64) - starts
    rows = starts[:, None] + src[None, :]  # (B, S_pad)
    valid = src[None, :] < lens[:, None]
    if t == 0:
        staged = raw.new_zeros((rows.shape[0], s_pad, h, d))
    else:
        staged = raw[rows.clamp(max=t - 1)]
        staged.mul_(valid[:, :, None, None].to(torch.uint8))
    return staged.permute(0, 2, 3, 1).contiguous().view(torch.float8_e4m3fn)
