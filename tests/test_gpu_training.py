"""Training with the kernels on a Hopper GPU (marked ``gpu``): a small model under
``torch.compile(fullgraph=True)`` against the same model with SDPA, and a forward + backward step
captured in a CUDA graph and replayed."""

import pytest
import torch

import fmha
from attention_model import train_losses

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper (SM90) GPU")]


def _losses(use_fmha, compile_backend):
    return train_losses(use_fmha, compile_backend, steps=4, lr=0.5, shape=(4, 300, 512), device="cuda",
                        fmha_backend="kernel")


def test_training_under_torch_compile_with_the_kernels_matches_sdpa():
    torch._dynamo.reset()
    sdpa = _losses(False, None)
    assert _losses(True, "inductor") == pytest.approx(sdpa, rel=5e-3)
    assert sdpa[-1] < sdpa[0]  # it trains


def test_forward_and_backward_replay_from_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 333, 8, 128, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(2, 333, 8, 128, generator=g, device="cuda").to(torch.bfloat16)

    def step():
        for t in (q, k, v):
            t.grad = None
        fmha.attention(q, k, v, causal=True, backend="kernel").backward(dout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles and warms up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    eager = [t.grad.clone() for t in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in (q, k, v):
        t.grad.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for replayed, want in zip((q.grad, k.grad, v.grad), eager):
        assert not replayed.isnan().any()
        torch.testing.assert_close(replayed, want, rtol=1e-2, atol=1e-2)
