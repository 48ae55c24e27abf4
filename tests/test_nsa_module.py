"""``fmha.nsa.NativeSparseAttention``: a small model trains, and its losses match the same model run
on the fp64 reference; packed sequences equal dense ones (positions restart per sequence);
torch.compile(fullgraph=True) traces it; the rotary embedding is a rotation by relative position."""

import pytest
import torch
import torch.nn.functional as F

import fmha.nsa as nsa
from test_nsa_naive import cu_of, one_thread  # noqa: F401 (one_thread: autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore")

SIZES = dict(block=8, stride=4, select_block=8, select_count=3, window=6)


class TinyModel(torch.nn.Module):
    def __init__(self, pooling="mean", hidden=32):
        super().__init__()
        self.inp = torch.nn.Linear(12, hidden)
        self.attn = nsa.NativeSparseAttention(hidden, 4, 2, 8, pooling=pooling, **SIZES)
        self.out = torch.nn.Linear(hidden, 12)

    def forward(self, x, cu_seqlens=None):
        h = self.inp(x)
        return self.out(h + self.attn(h, cu_seqlens))


def train_losses(model, x, y, steps=3, lr=0.2):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("pooling", ["mean", "mlp"])
def test_a_model_trains_and_matches_the_fp64_reference(pooling):
    torch.manual_seed(0)
    model = TinyModel(pooling).double()
    twin = TinyModel(pooling).double()
    twin.load_state_dict(model.state_dict())
    twin.attn.implementation = "reference"
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 29, 12, generator=g, dtype=torch.float64)
    y = torch.randn(2, 29, 12, generator=g, dtype=torch.float64)
    losses = train_losses(model, x, y)
    assert losses == pytest.approx(train_losses(twin, x, y), rel=1e-10, abs=0)
    assert losses[-1] < losses[0]
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-10, msg=f"{name} after training")


def test_packed_sequences_equal_dense_ones():
    torch.manual_seed(0)
    attn = nsa.NativeSparseAttention(32, 4, 1, 8, **SIZES).double()
    g = torch.Generator().manual_seed(2)
    a = torch.randn(1, 21, 32, generator=g, dtype=torch.float64)
    b = torch.randn(1, 6, 32, generator=g, dtype=torch.float64)
    packed = attn(torch.cat([a, b], 1), cu_of([21, 6]))
    torch.testing.assert_close(packed, torch.cat([attn(a), attn(b)], 1), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"\(1, T, hidden\)"):
        attn(torch.cat([a, a]), cu_of([21, 21]))


def test_mlp_pooling_reaches_the_compressed_keys():
    """With MLP pooling the module passes its own k_cmp/v_cmp: changing the pool changes o."""
    torch.manual_seed(0)
    attn = nsa.NativeSparseAttention(32, 2, 2, 8, pooling="mlp", **SIZES).double()
    x = torch.randn(1, 20, 32, dtype=torch.float64)
    before = attn(x)
    with torch.no_grad():
        attn.v_pool.mlp[2].bias.add_(1.0)
    assert not torch.allclose(attn(x), before)


def test_fullgraph_torch_compile_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = TinyModel().double()
    x = torch.randn(2, 23, 12, dtype=torch.float64)
    eager = model(x)
    eager.sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, eager, rtol=0, atol=1e-12)
    for p, want in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=1e-12)


def test_rotary_is_a_rotation_by_relative_position():
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))

    def score(pq, pk):
        rq = nsa.apply_rotary(q, torch.tensor([[pq]]))
        rk = nsa.apply_rotary(k, torch.tensor([[pk]]))
        return (rq * rk).sum(-1)

    torch.testing.assert_close(score(7, 3), score(14, 10))
    assert not torch.allclose(score(7, 3), score(7, 4))
    turned = nsa.apply_rotary(q, torch.tensor([[5]]))
    torch.testing.assert_close(turned.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(nsa.apply_rotary(q, torch.tensor([[0]])), q)
