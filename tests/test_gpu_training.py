"""Training with the kernels on a Hopper GPU (marked ``gpu``): a small model under
``torch.compile(fullgraph=True)`` against the same model with SDPA, and a forward + backward step
captured in a CUDA graph and replayed."""

import pytest
import torch
import torch.nn.functional as F

import fmha

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper (SM90) GPU")]


class _Block(torch.nn.Module):
    def __init__(self, use_fmha, d=512, heads=4):
        super().__init__()
        self.qkv, self.out, self.heads, self.use_fmha = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d), heads, use_fmha

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).to(torch.bfloat16).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if self.use_fmha:
            a = fmha.attention(q, k, v, causal=True, backend="kernel")
        else:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        return self.out(a.reshape(b, s, d).float())


def _losses(use_fmha, compiled, steps=4):
    torch.manual_seed(0)
    model = _Block(use_fmha).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step = torch.compile(model, fullgraph=True) if compiled else model
    x, y = torch.randn(4, 300, 512, device="cuda"), torch.randn(4, 300, 512, device="cuda")
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(step(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_under_torch_compile_with_the_kernels_matches_sdpa():
    torch._dynamo.reset()
    sdpa = _losses(False, False)
    assert _losses(True, True) == pytest.approx(sdpa, rel=5e-3)
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
