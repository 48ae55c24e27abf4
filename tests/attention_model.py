"""A one-block attention model and its training loop, for the tests that train with fmha and
compare the losses with the same model on SDPA (CPU in ``test_backward.py``, GPU in
``test_gpu_training.py``)."""

import torch
import torch.nn.functional as F

import fmha


class AttentionBlock(torch.nn.Module):
    """QKV projection, causal attention in bf16 (fmha, or SDPA for comparison), out projection."""

    def __init__(self, use_fmha, d, heads=4, fmha_backend="auto"):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.heads, self.use_fmha, self.fmha_backend = heads, use_fmha, fmha_backend

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).to(torch.bfloat16).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        if self.use_fmha:
            a = fmha.attention(q, k, v, causal=True, backend=self.fmha_backend)
        else:
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        return self.out(a.reshape(b, s, d).float())


def train_losses(use_fmha, compile_backend=None, steps=3, lr=0.1, shape=(2, 48, 128), device="cpu",
                 fmha_backend="auto"):
    """The losses of ``steps`` SGD steps from a fixed seed; ``compile_backend``: run the model
    under ``torch.compile(fullgraph=True)`` with that backend (None: eager)."""
    torch.manual_seed(0)
    model = AttentionBlock(use_fmha, shape[-1], fmha_backend=fmha_backend).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    step = torch.compile(model, fullgraph=True, backend=compile_backend) if compile_backend else model
    x, y = torch.randn(*shape, device=device), torch.randn(*shape, device=device)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(step(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses
