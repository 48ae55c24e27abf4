"""Input errors that kernels find on the GPU, reported to the host without waiting for it.

A varlen call given both ``max_seqlen_q`` and ``max_seqlen_k`` does not read ``cu_seqlens`` on the
host (that read waits for the GPU). Its offsets are checked by the kernels' descriptor pass
instead: offsets that are out of order or out of range, or a sequence longer than its max length,
are clamped there (so nothing is read or written out of bounds, though that call's results are
wrong) and raise a flag on the device. ``attention_with_kvcache`` on the kernel path checks its
cache lengths and block table the same way. After each such call the flag is copied to pinned host
memory without a sync or an event; the next such call on the device raises the error once that
copy has landed, and ``fmha.check_device_errors()`` waits for it and raises it at once.
"""

from __future__ import annotations

from typing import Dict

import torch

from .kernels.common.error_bits import BAD_BLOCK_TABLE, BAD_CACHE_LENGTH, BAD_OFFSETS

_MESSAGES = {
    BAD_OFFSETS: "an earlier varlen call on this GPU had invalid cu_seqlens (checked on the device because "
                 "max_seqlen_q and max_seqlen_k were given, or the keys were in a KV cache): offsets must start "
                 "at 0, never decrease, end at the number of rows (packed queries over a cache: at most that), "
                 "and no sequence may be longer than its max_seqlen. That call's outputs are wrong; leave out "
                 "max_seqlen_q/max_seqlen_k of a packed call to have cu_seqlens checked on the host",
    BAD_CACHE_LENGTH: "an earlier call over a KV cache on this GPU (attention_with_kvcache, or attention_varlen "
                      "with seqused_k) had a cache_seqlens / seqused_k entry below 0, or one that with the new "
                      "keys did not fit the cache (its rows, or block_table columns x page size). That call's "
                      "outputs are wrong",
    BAD_BLOCK_TABLE: "an earlier call over a paged KV cache on this GPU (attention_with_kvcache, or "
                     "attention_varlen with block_table) had a block_table entry that is not a page of the cache "
                     "(0 .. num_pages - 1) for a position below the sequence's length. That call's outputs are "
                     "wrong",
}


class _DeviceFlag:
    def __init__(self, device: torch.device):
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.host = torch.zeros(1, dtype=torch.int32).pin_memory()
        self.host_value = self.host.numpy()  # reads the pinned word without a tensor op
        self.watched = False


_flags: Dict[int, _DeviceFlag] = {}


def _state(device: torch.device) -> _DeviceFlag:
    index = device.index if device.index is not None else torch.cuda.current_device()
    state = _flags.get(index)
    if state is None:
        with torch.cuda.device(index):
            state = _flags[index] = _DeviceFlag(torch.device("cuda", index))
    return state


def flag(device: torch.device) -> torch.Tensor:
    """The device's error flag (int32, one element), for kernels to set."""
    return _state(device).flag


def watch(device: torch.device) -> None:
    """After a call whose offsets were checked on the device: start copying the flag back (no
    event: the word in pinned memory is 0 until a copy brings a set flag)."""
    if torch.cuda.is_current_stream_capturing():
        return  # a graph replays without the host: check_device_errors() after replays instead
    state = _state(device)
    state.host.copy_(state.flag, non_blocking=True)
    state.watched = True


def _raise_if_set(state: _DeviceFlag) -> None:
    state.watched = False
    code = int(state.host_value[0])
    if code:
        state.host.zero_()
        state.flag.zero_()
        found = [text for bit, text in _MESSAGES.items() if code & bit]
        raise ValueError("; and ".join(found) or f"a kernel on this GPU reported input error {code}")


def raise_pending(device: torch.device) -> None:
    """Raise the error of an earlier call on ``device`` if its flag has come back (no waiting
    unless it has: then the copies still in flight land first, so one error raises once)."""
    state = _flags.get(device.index if device.index is not None else torch.cuda.current_device())
    if state is None or not state.watched or not state.host_value[0]:
        return
    if torch.cuda.is_current_stream_capturing():
        return  # a synchronization is not allowed while a graph is being captured
    torch.cuda.synchronize(state.flag.device)
    state.host.copy_(state.flag)
    _raise_if_set(state)


def check_device_errors() -> None:
    """Wait for the flags of every GPU's earlier calls and raise if any call had bad offsets."""
    for state in _flags.values():
        if torch.cuda.is_current_stream_capturing():
            return
        with torch.cuda.device(state.flag.device):
            state.host.copy_(state.flag)
        _raise_if_set(state)
