"""The selection kernel's visits (``fmha.nsa.selection_visits``), checked on the CPU by running
them the way the kernel does (``emulate``: each query tile of a few tokens' GQA heads walks its
entries, a tile of keys from each entry's first row, masked per token by the entry's bits where
the entry is listed as masked) and comparing with the PyTorch gather path in fp64: GQA groups of
2, 4, 8 and 16 (bit 31 used at 2), selection blocks below, equal to and above the key tile,
empty and length-1 sequences, -1 and future entries, blocks an unchecked list names twice."""

import math

import pytest
import torch

from fmha.nsa import selection as S
from fmha.nsa.selection_visits import selection_visits
from test_nsa_selection_blocks import _case

TILE_M, TILE_N = 64, 64


def emulate(q, k, v, sel, cu, select_block, scale):
    """(o, lse) of the visits as the kernel computes them, and the kept (row, key) pairs."""
    total, heads_q, _ = q.shape
    heads_k = k.shape[1]
    g = heads_q // heads_k
    per_tile = TILE_M // g
    visits = selection_visits(sel, cu, select_block, per_tile, TILE_N)
    counts, rows, bits = (t[0] for t in visits)
    length = min(select_block, TILE_N)
    o = torch.zeros(total, heads_q, v.shape[-1], dtype=torch.float64)
    lse = torch.full((heads_q, total), -math.inf, dtype=torch.float64)
    kept_all = torch.zeros(heads_k, total * g, total, dtype=torch.int64)
    for h in range(heads_k):
        for m in range(counts.shape[1]):
            r0 = m * TILE_M
            row_ids = torch.arange(r0, min(r0 + TILE_M, total * g))
            tokens = row_ids // g
            keep = torch.zeros(row_ids.numel(), total, dtype=torch.bool)
            masked, whole = int(counts[h, m, 0]), int(counts[h, m, 1])
            for e in range(masked + whole):
                start = int(rows[h, m, e])
                keys = torch.arange(start, min(start + TILE_N, total))
                if e >= masked:  # unmasked: the whole tile of keys, for every row
                    assert start + TILE_N <= total
                    keep[:, keys] = True
                    kept_all[h, row_ids[:, None], keys[None, :]] += 1
                    continue
                chose = ((int(bits[h, m, e]) & 0xFFFFFFFF) >> (tokens - m * per_tile)) & 1
                k_ok = (keys[None, :] < start + length) & (keys[None, :] <= tokens[:, None]) & (chose[:, None] == 1)
                keep[:, keys] |= k_ok
                kept_all[h, row_ids[:, None], keys[None, :]] += k_ok.long()
            heads = h * g + row_ids % g
            s = torch.einsum("rd,rkd->rk", q[tokens, heads], k[None, :, h].expand(row_ids.numel(), -1, -1)) * scale
            s = s.masked_fill(~keep, -math.inf)
            mx = s.amax(-1, keepdim=True)
            mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
            p = (s - mx).exp()
            den = p.sum(-1, keepdim=True)
            o[tokens, heads] = (p @ v[:, h]) / torch.where(den > 0, den, torch.ones_like(den))
            lse[heads, tokens] = torch.where(den[:, 0] > 0, mx[:, 0] + den[:, 0].log(), -math.inf)
    return o, lse, kept_all


CASES = [([0, 1, 70, 130, 5], 16, 2, 64, 3), ([200, 77], 8, 2, 32, 4), ([33, 0, 97], 4, 1, 16, 5),
         ([150, 1], 2, 1, 100, 2), ([300, 3], 4, 2, 128, 3), ([129], 2, 1, 64, 3), ([260, 70], 16, 1, 64, 4)]


@pytest.mark.parametrize("lens,heads_q,heads_k,select_block,count", CASES)
def test_the_visits_compute_selection_attention(lens, heads_q, heads_k, select_block, count):
    if select_block > TILE_N and select_block % TILE_N:
        with pytest.raises(ValueError, match="neither at most one key tile"):
            selection_visits(torch.zeros(1, 1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                             select_block, 4, TILE_N)
        return
    q, k, v, sel, cu = _case(lens, heads_q, heads_k, select_block, count, seed=len(lens) * 7 + select_block)
    scale = 0.3
    want_o, want_lse = S._selection_forward_torch(q, k, v, sel, cu, select_block, scale)
    o, lse, kept = emulate(q, k, v, sel, cu, select_block, scale)
    assert int(kept.max()) <= 1  # no key is counted twice for a row
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-10)
    assert torch.allclose(o, want_o, atol=1e-10)


def test_whole_entries_skip_the_mask_and_come_last():
    """Four tokens of one sequence all choosing blocks 0 and 1 before them: both whole, listed
    after the blocks only some chose; the current block (it holds the tokens) stays masked."""
    total, p = 260, 4
    cu = torch.tensor([0, total], dtype=torch.int32)
    sel = torch.full((total, 1, 3), -1, dtype=torch.int32)
    for t in range(total):
        sel[t, 0] = torch.tensor([0, 1, t // 64]) if t >= 128 else torch.tensor([t // 64, -1, -1])
    sel[200, 0, 1] = 3  # block 3 lies after token 200: dropped, and block 1 not chosen by it
    counts, rows, bits = (t[0, 0] for t in selection_visits(sel, cu, 64, p, 64))
    m = 192 // p  # tokens 192..195
    assert counts[m].tolist() == [1, 2] and rows[m, :3].tolist() == [192, 0, 64] and bits[m, 0] == 0b1111
    m = 200 // p  # tokens 200..203: 200 did not choose block 1
    assert counts[m].tolist() == [2, 1] and rows[m, :3].tolist() == [64, 192, 0]
    assert bits[m, 0] == 0b1110


def test_a_block_named_twice_counts_once_and_bit_31_is_kept():
    total, p = 64, 32  # two heads per group: 32 tokens per tile
    cu = torch.tensor([0, total], dtype=torch.int32)
    sel = torch.zeros((total, 1, 2), dtype=torch.int32)  # block 0, twice
    counts, rows, bits = (t[0, 0] for t in selection_visits(sel, cu, 64, p, 64))
    assert counts.tolist() == [[1, 0], [1, 0]] and rows[:, 0].tolist() == [0, 0]
    assert bits[0, 0] == -1 and bits[1, 0] == -1  # all 32 tokens: bit 31 is the sign bit
