"""Gradients of fmha.nsa: torch.autograd.gradcheck in fp64 on tiny varlen batches (empty and
length-1 sequences, queries that see no compressed block) for each branch, the pooling and the
whole composition; and the composition's gradients against autograd through the fp64 reference."""

import pytest
import torch

import fmha.nsa as nsa
from test_nsa import gates, inputs, random_selection
from test_nsa_naive import one_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore")

LENS = [0, 1, 6, 11]
GEOMETRY = dict(block=4, stride=2, select_block=4, select_count=2, window=3)


def finite(t):
    """-inf LSE entries (nothing seen) have no derivative; gradcheck compares the rest."""
    return torch.where(torch.isfinite(t), t, torch.zeros_like(t))


def leaves(*tensors):
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2)])
def test_gradcheck_compression_branch(hq, hk):
    q, k, v, cu = inputs(LENS, hq, hk, d=4, dv=3)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    v_cmp, _ = nsa.mean_pool(v, cu, 4, 2)
    args = leaves(q, k_cmp, v_cmp)

    def f(q, kc, vc):
        o, lse = nsa.compression_attention(q, kc, vc, cu, cu_cmp, 4, 2)
        return o, finite(lse)

    # the whole Jacobian for one GQA case; a random direction for the other (fast mode)
    assert torch.autograd.gradcheck(f, args, fast_mode=hq != hk)


@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 1)])
def test_gradcheck_selection_attention(hq, hk):
    q, k, v, cu = inputs(LENS, hq, hk, d=4, dv=3, seed=1)
    sel = random_selection(LENS, hk, 2, 4)

    def f(q, k, v):
        o, lse = nsa.selection_attention(q, k, v, sel, cu, 4)
        return o, finite(lse)

    assert torch.autograd.gradcheck(f, leaves(q, k, v))


def test_gradcheck_window_branch():
    q, k, v, cu = inputs(LENS, 4, 2, d=4, dv=3, seed=2)
    # fmha's own tests check its window backward in full; here the call as NSA makes it
    assert torch.autograd.gradcheck(lambda q, k, v: nsa.window_attention(q, k, v, cu, 3), leaves(q, k, v),
                                    fast_mode=True)


def test_gradcheck_mean_and_mlp_pooling():
    _, k, _, cu = inputs(LENS, 1, 2, d=4, seed=3)
    assert torch.autograd.gradcheck(lambda x: nsa.mean_pool(x, cu, 4, 2)[0], leaves(k))
    dense = k[7:18].reshape(1, 11, 2, 4)
    assert torch.autograd.gradcheck(lambda x: nsa.mean_pool(x, None, 4, 2)[0], leaves(dense))
    torch.manual_seed(0)
    pool = nsa.MLPPool(4, block=4, stride=2, hidden=5).double()
    assert torch.autograd.gradcheck(lambda x: pool(x, cu)[0], leaves(k))
    out, _ = pool(k, cu)
    out.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pool.parameters())


@pytest.mark.parametrize("given_selection", [True, False])
def test_gradcheck_nsa_attention(given_selection):
    """Through the gates, q, k (its pooling too) and v. Without a given selection the top-k
    picks blocks from q and k: piecewise constant, so the gradient treats the choice as fixed
    and finite differences agree while no perturbation flips it (none does on these inputs)."""
    q, k, v, cu = inputs(LENS, 4, 2, d=4, dv=3, seed=4)
    gs = gates(q.shape[0], 4, seed=2)
    sel = random_selection(LENS, 2, 2, 4, seed=2) if given_selection else None

    def f(q, k, v, g_cmp, g_slc, g_win):
        return nsa.nsa_attention(q, k, v, g_cmp, g_slc, g_win, cu_seqlens=cu, selected=sel, **GEOMETRY)

    # fast mode: one random direction per output (the full Jacobian would take ~1500 calls)
    assert torch.autograd.gradcheck(f, leaves(q, k, v, *gs), fast_mode=True)


def test_nsa_attention_gradients_match_autograd_through_the_reference():
    lens = [0, 1, 13, 30]
    kw = dict(block=8, stride=4, select_block=8, select_count=3, window=6)
    q, k, v, cu = inputs(lens, 4, 2, seed=5)
    gs = gates(q.shape[0], 4, seed=3)
    dout = torch.randn(q.shape[0], 4, 6, dtype=torch.float64)
    fast, slow = leaves(q, k, v, *gs), leaves(q, k, v, *gs)
    nsa.nsa_attention(*fast, cu_seqlens=cu, **kw).backward(dout)
    nsa.nsa_reference(*slow, cu_seqlens=cu, **kw).backward(dout)
    for name, a, b in zip(("q", "k", "v", "g_cmp", "g_slc", "g_win"), fast, slow):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-10, msg=f"d{name} differs")


def test_a_branch_lse_alone_can_be_differentiated():
    q, k, v, cu = inputs(LENS, 2, 1, d=4, dv=3, seed=6)
    q, k, v = leaves(q, k, v)
    sel = random_selection(LENS, 1, 2, 4, seed=3)
    _, lse = nsa.selection_attention(q, k, v, sel, cu, 4)
    finite(lse).sum().backward()
    assert q.grad.abs().sum() > 0 and k.grad.abs().sum() > 0 and v.grad.abs().sum() == 0
    k_cmp, cu_cmp = nsa.mean_pool(k.detach(), cu, 4, 2)
    q.grad = None
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, 4, 2)
    finite(lse).sum().backward()
    assert q.grad.abs().sum() > 0


def test_selected_blocks_carry_no_gradient():
    q, k, v, cu = inputs(LENS, 2, 1, d=4, seed=7)
    q, k = leaves(q, k)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, 4, 2)
    sel = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, 4, 2, 4, 2)
    assert sel.dtype == torch.int32 and not sel.requires_grad


def test_deterministic_reaches_every_branch_and_gives_the_same_gradients():
    """``nsa_attention(deterministic=True)`` (and the module's): the same gradients as without
    (on the CPU both are exact sums in one order), every branch's op called with it; anything but
    a bool is refused."""
    from fmha import api
    from fmha.nsa import selection

    q, k, v, cu = inputs(LENS, 4, 2, d=4, dv=3)
    g = gates(q.shape[0], 4)
    seen = []
    for deterministic in (False, True):
        args = leaves(q, k, v, *g)
        real = api.attention_varlen
        calls = []

        def spy(*a, **kw):
            calls.append(kw.get("deterministic"))
            return real(*a, **kw)

        api.attention_varlen = spy
        try:
            o = nsa.nsa_attention(*args, cu_seqlens=cu, deterministic=deterministic, **GEOMETRY)
        finally:
            api.attention_varlen = real
        assert calls == [deterministic, deterministic]  # compression and window
        seen.append(torch.autograd.grad(o.square().sum(), args))
    for a, b in zip(*seen):
        assert torch.allclose(a, b, atol=1e-12)
    sel = random_selection(LENS, 2, 2, 4, seed=1)
    for deterministic in (False, True):
        args = leaves(q, k, v)
        o, _ = selection.selection_attention(*args, sel, cu, 4, deterministic=deterministic)
        seen.append(torch.autograd.grad(o.square().sum(), args))
    for a, b in zip(*seen[2:]):
        assert torch.equal(a, b)
    for bad in (1, None, "yes"):
        with pytest.raises(TypeError, match="deterministic"):
            nsa.nsa_attention(q, k, v, *g, cu_seqlens=cu, deterministic=bad, **GEOMETRY)
        with pytest.raises(TypeError, match="deterministic"):
            nsa.NativeSparseAttention(32, 4, 2, deterministic=bad)
