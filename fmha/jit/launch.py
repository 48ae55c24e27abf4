"""What a launch needs to know about the GPU it runs on."""

from __future__ import annotations

import contextlib

import torch

_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the persistent grids' CTA count."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def answered_without_launch(problem, out: torch.Tensor, lse, sinks=None) -> bool:
    """Write the answer of a forward with nothing to launch and say so: no query rows (a
    zero-size grid is not a launch), or no keys at all (a TMA descriptor needs a non-empty
    tensor), where O = 0 and LSE = -inf (its head's sink with ``sinks``)."""
    if problem.total_q == 0 or problem.num_heads_q == 0:
        return True
    if problem.total_k == 0:
        out.zero_()
        if lse is not None:
            fill_empty_lse(lse, sinks)
        return True
    return False


def fill_empty_lse(lse: torch.Tensor, sinks=None) -> None:
    """The LSE of rows that keep no key, (B, H, S) or (H, T): -inf, or their head's sink."""
    if sinks is None:
        lse.fill_(float("-inf"))
    else:
        lse.copy_(sinks.to(lse.dtype).view(-1, 1).expand(lse.shape[-2:]))


def sinks_fp32(sinks: torch.Tensor) -> torch.Tensor:
    """The kernels read the sink logits as fp32."""
    return sinks if sinks.dtype == torch.float32 else sinks.float()


@contextlib.contextmanager
def persistent_grid_of(num_ctas: int, device_index: int):
    """Persistent launches on ``device_index`` use ``num_ctas`` CTAs inside the block (the GPU
    tests and the sanitizer cases: a small grid makes every CTA run, and claim, several tiles of
    a small problem); the SM count is looked up again afterwards."""
    _SM_COUNT[device_index] = num_ctas
    try:
        yield
    finally:
        _SM_COUNT.pop(device_index, None)


def mod_tensors(mods):
    """What a launch passes for a call's mod tensors (None for none: an empty tuple is no kernel
    argument)."""
    return (mods.kernel_tensors() or None) if mods is not None else None
