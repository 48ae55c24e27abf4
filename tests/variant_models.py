"""Two small decoder models whose attention needs a variant, each written twice: with fmha, and
with attention spelled out in eager PyTorch (scores, mask, softmax, in fp32), for the tests that
train both from the same seed and compare the losses (``test_variant_models.py`` on the CPU,
``test_gpu_variant_models.py`` with the Hopper kernels).

* ``gpt_oss``: GQA, a learned sink logit per query head, layers alternating a 128-key sliding
  window with full causal attention.
* ``gemma2``: GQA, scores capped at 50 * tanh(s / 50), layers alternating a 64-key sliding window
  with full causal attention.
"""

import math

import torch
import torch.nn.functional as F

import fmha

STYLES = {
    # softcap, sinks, sliding window (keys a row sees, itself included)
    "gpt_oss": dict(softcap=0.0, sinks=True, window=128),
    "gemma2": dict(softcap=50.0, sinks=False, window=64),
}


def eager_attention(q, k, v, window, softcap, sinks):
    """q (B, S, H_q, D), k/v (B, S, H_k, D) -> (B, S, H_q, D): causal, keys within ``window``
    of the row when it is given, in fp32."""
    b, s, hq, d = q.shape
    group = hq // k.shape[2]
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
    scores = qf @ kf.transpose(-1, -2) / math.sqrt(d)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    keep = j <= i
    if window:
        keep &= j > i - window
    scores = scores.masked_fill(~keep, -math.inf)
    if sinks is not None:
        sink_col = sinks.float().view(1, hq, 1, 1).expand(b, hq, s, 1)
        p = torch.softmax(torch.cat([scores, sink_col], -1), -1)[..., :-1]
    else:
        p = torch.softmax(scores, -1)
    return (p @ vf).transpose(1, 2).to(q.dtype)


class Layer(torch.nn.Module):
    def __init__(self, dim, heads_q, heads_k, style, windowed, use_fmha, backend):
        super().__init__()
        self.hd = dim // heads_q
        self.hq, self.hk = heads_q, heads_k
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.q = torch.nn.Linear(dim, heads_q * self.hd)
        self.kv = torch.nn.Linear(dim, 2 * heads_k * self.hd)
        self.o = torch.nn.Linear(heads_q * self.hd, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 2 * dim), torch.nn.GELU(), torch.nn.Linear(2 * dim, dim))
        cfg = STYLES[style]
        self.softcap = cfg["softcap"]
        self.window = cfg["window"] if windowed else 0
        self.sinks = torch.nn.Parameter(torch.randn(heads_q)) if cfg["sinks"] else None
        self.use_fmha, self.backend = use_fmha, backend

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).to(torch.bfloat16).view(b, s, self.hq, self.hd)
        k, v = self.kv(h).to(torch.bfloat16).view(b, s, 2, self.hk, self.hd).unbind(2)
        if self.use_fmha:
            window = (self.window - 1, 0) if self.window else None
            a = fmha.attention(q, k, v, causal=True, window_size=window, softcap=self.softcap, sinks=self.sinks,
                               backend=self.backend)
        else:
            a = eager_attention(q, k, v, self.window, self.softcap, self.sinks)
        x = x + self.o(a.reshape(b, s, -1).float())
        return x + self.mlp(self.norm2(x))


class Decoder(torch.nn.Module):
    def __init__(self, style, use_fmha, backend="auto", dim=256, heads_q=4, heads_k=2, layers=2, vocab=97):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(
            Layer(dim, heads_q, heads_k, style, i % 2 == 0, use_fmha, backend) for i in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def train_losses(style, use_fmha, backend="auto", steps=4, shape=(2, 200), device="cpu", lr=0.05):
    """The losses of ``steps`` SGD steps of next-token prediction from a fixed seed, and each
    layer's sinks gradient of the first step (empty without sinks)."""
    torch.manual_seed(0)
    model = Decoder(style, use_fmha, backend).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    tokens = torch.randint(0, 97, shape, device=device)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if not losses:
            sink_grads = [layer.sinks.grad.cpu().clone() for layer in model.layers if layer.sinks is not None]
        opt.step()
        losses.append(loss.item())
    return losses, sink_grads


def assert_matches_eager(style, fmha_run, eager_run, loss_rtol: float, grad_rtol: float):
    """``train_losses``' (losses, sinks' gradients) of fmha against the eager model's: the eager
    model learns, every loss within ``loss_rtol``, each layer's sinks gradient within
    ``grad_rtol`` (relative L2)."""
    (got, got_sinks), (want, want_sinks) = fmha_run, eager_run
    assert want[-1] < want[0]  # it learns, so the comparison is of a moving model
    for g, w in zip(got, want):
        assert abs(g - w) < loss_rtol * abs(w)
    assert len(got_sinks) == len(want_sinks) == (2 if STYLES[style]["sinks"] else 0)
    for g, w in zip(got_sinks, want_sinks):  # each layer's sinks gradient
        assert w.abs().max() > 0
        assert (g - w).norm() < grad_rtol * w.norm()
