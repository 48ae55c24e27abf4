"""Selection attention as a block mask and a mask mod (``fmha.nsa.selection_blocks``, the form
fmha's kernels run), against the PyTorch gather path, on the CPU through fmha's reference of
block-masked attention: forward, LSE and gradients in fp64, empty and length-1 sequences, GQA,
selection blocks that do not align with the mask's 64-token blocks; and the block mask lists
exactly the blocks that hold a kept key."""

import pytest
import torch

import fmha
from fmha.nsa import selection as S
from fmha.nsa.layout import token_positions
from fmha.nsa.selection_blocks import BLOCK, selection_mask


def _case(lens, heads_q, heads_k, select_block, count, seed):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    total = int(cu[-1])
    q = torch.randn(total, heads_q, 32, generator=g, dtype=torch.float64)
    k, v = (torch.randn(total, heads_k, 32, generator=g, dtype=torch.float64) for _ in range(2))
    where = token_positions(cu, total)
    blocks = (where.length + select_block - 1) // select_block
    sel = torch.full((total, heads_k, count), -1, dtype=torch.int32)
    for t in range(total):
        for h in range(heads_k):
            chosen = torch.randperm(int(blocks[t]), generator=g)[:count]  # future blocks too: causal drops them
            if int(blocks[t]) > 64 and t % 3 == 0:  # blocks at a word's last bit and the next word's first
                chosen = torch.tensor([31, 32, 63, 64, 0, 1][:count])
            sel[t, h, :chosen.numel()] = chosen.int()
    return q, k, v, sel, cu


CASES = [([0, 1, 70, 130, 5], 4, 2, 16, 3), ([200], 2, 2, 64, 2), ([33, 0, 97], 6, 3, 5, 4), ([150, 1], 2, 1, 100, 1),
         ([300], 2, 1, 4, 6)]  # 75 blocks: words past the first, bit 31 (the sign) included


@pytest.mark.parametrize("lens,heads_q,heads_k,select_block,count", CASES)
def test_block_mask_form_equals_the_gather_path(lens, heads_q, heads_k, select_block, count):
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=len(lens) + select_block)
    scale = 32 ** -0.5
    want_o, want_lse = S._selection_forward_torch(q, k, v, sel, cu, select_block, scale)
    bm, aux = selection_mask(sel, cu, select_block, heads_q)
    o, lse = fmha.attention(q[None], k[None], v[None], causal=True, softmax_scale=scale, block_mask=bm, aux=aux,
                            return_lse=True, backend="reference")
    torch.testing.assert_close(o[0], want_o, atol=1e-12, rtol=1e-12)
    assert torch.equal(torch.isneginf(lse[0]), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    torch.testing.assert_close(lse[0][finite], want_lse[finite], atol=1e-12, rtol=1e-12)

    g = torch.Generator().manual_seed(1)
    dout = torch.randn(o[0].shape, generator=g, dtype=torch.float64)
    want = S._selection_backward_torch(dout, q, k, v, want_o, want_lse, None, sel, cu, select_block, scale)
    got = fmha.attention_backward(dout[None], q[None], k[None], v[None], o, lse, causal=True, softmax_scale=scale,
                                  block_mask=bm, aux=aux, backend="reference")
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a[0], b, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.parametrize("lens,heads_q,heads_k,select_block,count", CASES)
def test_block_mask_lists_exactly_the_blocks_with_kept_keys(lens, heads_q, heads_k, select_block, count):
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=3)
    bm, aux = selection_mask(sel, cu, select_block, heads_q)
    total = q.shape[0]
    where = token_positions(cu, total)
    keep = torch.zeros(heads_q, total, total, dtype=torch.bool)  # brute force from the lists
    for t in range(total):
        for h in range(heads_q):
            for s in sel[t, h // (heads_q // heads_k)].tolist():
                if s >= 0:
                    lo = int(where.start[t]) + s * select_block
                    hi = min(lo + select_block, int(where.start[t] + where.length[t]), t + 1)
                    keep[h, t, lo:max(lo, hi)] = True
    nb = -(-total // BLOCK)
    padded = torch.zeros(heads_q, nb * BLOCK, nb * BLOCK, dtype=torch.bool)
    padded[:, :total, :total] = keep
    want = padded.view(heads_q, nb, BLOCK, nb, BLOCK).any(4).any(2)
    assert torch.equal(bm.states[0] != 0, want)
    # the mask mod keeps exactly those keys (with the causal mask beside it)
    mod = bm.mask_mod.fn
    h, t, j = torch.arange(heads_q).view(-1, 1, 1), torch.arange(total).view(1, -1, 1), torch.arange(total).view(1, 1, -1)
    assert torch.equal(mod(torch.tensor(0), h, t, j, aux) & (j <= t), keep)


def test_unchecked_lists_with_duplicates_and_indices_past_every_block():
    """Lists the checks did not read: a block named twice is kept once, an index past every
    block keeps nothing (and neither writes out of range)."""
    q, k, v, sel, cu = _case([130], 2, 1, 16, 3, seed=5)
    odd = sel.clone()
    odd[:, :, 1] = odd[:, :, 0]  # the first block twice
    odd[:, :, 2] = 10 ** 6
    once = sel.clone()
    once[:, :, 1:] = -1
    a = selection_mask(odd, cu, 16, 2)[0].states
    b = selection_mask(once, cu, 16, 2)[0].states
    assert torch.equal(a, b)
    aux_a, aux_b = selection_mask(odd, cu, 16, 2)[1], selection_mask(once, cu, 16, 2)[1]
    assert torch.equal(aux_a[1], aux_b[1])



def test_auto_tries_the_kernel_form_and_falls_back_where_it_is_refused(monkeypatch):
    """'auto' on CUDA runs the kernel form; where fmha refuses it (UnsupportedError, before any
    launch) the PyTorch path answers, forward and backward; 'kernel' raises the refusal."""
    q, k, v, sel, cu = _case([70, 5], 4, 2, 16, 3, seed=3)
    q.requires_grad_(True)
    calls, try_kernels = [], S._try_kernels

    def refused(*args):
        calls.append(len(args))
        raise fmha.UnsupportedError(["no kernel here"])

    monkeypatch.setattr(S, "_try_kernels", lambda backend, q: backend in ("auto", "kernel"))
    monkeypatch.setattr(S, "_selection_forward_kernels", refused)
    monkeypatch.setattr(S, "_selection_backward_kernels", refused)
    o, lse = S.selection_attention(q, k, v, sel, cu, 16, backend="auto")
    o.sum().backward()
    assert len(calls) == 2  # the forward and the backward each tried the kernels first
    want_o, _ = S._selection_forward_torch(q.detach(), k, v, sel, cu, 16, 32 ** -0.5)
    torch.testing.assert_close(o.detach(), want_o, atol=1e-12, rtol=1e-12)
    with pytest.raises(fmha.UnsupportedError, match="no kernel here"):
        S.selection_attention(q, k, v, sel, cu, 16, backend="kernel")
    assert not try_kernels("auto", torch.zeros(1)) and not try_kernels("reference", torch.zeros(1))
