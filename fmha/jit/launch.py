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
