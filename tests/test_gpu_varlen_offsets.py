"""Varlen calls given max_seqlen_q and max_seqlen_k read nothing back from the GPU: the offsets
are checked by the kernels (``fmha.device_errors``). Marked ``gpu``; skipped without Hopper."""

import itertools
import math

import pytest
import torch

import fmha

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper GPU")]


def _cu(lens):
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")


def _packed(lens, heads=(4, 2), d=64, grad=False):
    t = sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(len(lens) * 1000 + t)
    q, k, v = (torch.randn(t, h, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_(grad)
               for h in (heads[0], heads[1], heads[1]))
    return q, k, v


def test_training_steps_with_new_offsets_never_wait_for_the_gpu():
    """Forward and backward (autograd) with a new cu_seqlens tensor every step, under torch's
    sync debug mode set to raise on any call that waits for the GPU; the results match the
    host-checked call's."""
    batches = [(100, 0, 200, 1), (5, 300, 17), (1000, 1, 64)]
    for lens in batches:  # compile first (the disk cache read is host work only)
        q, k, v = _packed(lens, grad=True)
        fmha.attention_varlen(q, k, v, _cu(lens), _cu(lens), max(lens), max(lens), causal=True).sum().backward()
    torch.cuda.synchronize()
    for lens in batches:
        q, k, v = _packed(lens, grad=True)
        cu = _cu(lens)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = fmha.attention_varlen(q, k, v, cu, cu.clone(), max(lens), max(lens), causal=True)
            out.backward(torch.ones_like(out))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        want = fmha.attention_varlen(q, k, v, cu, cu.clone(), causal=True)  # offsets read on the host
        want.backward(torch.ones_like(want))
        assert torch.allclose(out.float(), want.float(), rtol=1e-2, atol=1e-2)
        for got, t in zip(grads, (q, k, v)):
            assert torch.allclose(got.float(), t.grad.float(), rtol=1e-2, atol=1e-2)
    fmha.check_device_errors()  # nothing was flagged


@pytest.mark.parametrize("bad", ["decreasing", "past_the_end", "longer_than_max", "first_not_zero"])
def test_bad_offsets_are_flagged_and_nothing_outside_the_tensors_is_touched(bad):
    lens = [100, 50, 200]
    q, k, v = _packed(lens)
    t = sum(lens)
    offsets = [0, 100, 150, t]
    max_len = 200
    if bad == "decreasing":
        offsets = [0, 120, 90, t]
    elif bad == "past_the_end":
        offsets = [0, 100, 150, t + 4096]
    elif bad == "longer_than_max":
        max_len = 150
    elif bad == "first_not_zero":
        offsets = [7, 100, 150, t]
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    guard = 64
    obuf = torch.full((t + guard, 4, 64), math.nan, dtype=torch.bfloat16, device="cuda")
    out = obuf[:t]
    fmha.attention_varlen(q, k, v, cu, cu, max_len, max_len, out=out)
    with pytest.raises(ValueError, match="invalid cu_seqlens"):
        fmha.check_device_errors()
    assert torch.isnan(obuf[t:]).all()  # the guard rows after the output were not written
    fmha.check_device_errors()  # raised once, then cleared
    # the next call raises it without a sync, once the flag's copy has landed
    fmha.attention_varlen(q, k, v, cu, cu, max_len, max_len, out=out)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="invalid cu_seqlens"):
        fmha.attention_varlen(q, k, v, _cu(lens), _cu(lens), 200, 200)
    fmha.check_device_errors()


@pytest.mark.parametrize("bad", ["decreasing", "past_the_end", "longer_than_max", "first_not_zero"])
def test_bad_offsets_in_the_backward_are_flagged_and_its_gradients_stay_in_their_buffers(bad):
    """The backward with offsets the host did not read: its passes clamp them as the forward's
    kernels do (the row pass that zeroes the tiled dQ accumulator included), write no gradient row
    outside dq/dk/dv, and flag them."""
    lens = [100, 50, 200]
    q, k, v = _packed(lens)
    t = sum(lens)
    out, lse = fmha.attention_varlen(q, k, v, _cu(lens), _cu(lens), 200, 200, return_lse=True)
    offsets = {"decreasing": [0, 120, 90, t], "past_the_end": [0, 100, 150, t + 4096],
               "first_not_zero": [7, 100, 150, t]}.get(bad, [0, 100, 150, t])
    max_len = 150 if bad == "longer_than_max" else 200
    cu = torch.tensor(offsets, dtype=torch.int32, device="cuda")
    guard = 64
    bufs = [torch.full((t + guard, *x.shape[1:]), math.nan, dtype=x.dtype, device="cuda") for x in (q, k, v)]
    fmha.attention_backward(torch.ones_like(out), q, k, v, out, lse, cu, cu, max_len, max_len,
                            dq=bufs[0][:t], dk=bufs[1][:t], dv=bufs[2][:t])
    with pytest.raises(ValueError, match="invalid cu_seqlens"):
        fmha.check_device_errors()
    for buf in bufs:
        assert torch.isnan(buf[t:]).all()  # the guard rows after each gradient were not written
    fmha.check_device_errors()  # raised once, then cleared
