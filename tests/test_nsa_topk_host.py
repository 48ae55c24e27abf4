"""The fused top-k kernel's host side (``kernels/hopper/topk_runner.py``), without a GPU: what it
serves and what it refuses with a reason, and the scores it holds per token."""

import pytest
import torch

from fmha.kernels.hopper.topk_runner import SHARED_BYTES, config_of, score_capacity, why_unsupported_topk
from fmha.nsa.topk import TopKProblem


def problem(dtype=torch.bfloat16, d=128, hq=64, hk=4, count=16, max_seqlen=65536, select_block=64):
    return TopKProblem(dtype, d, hq, hk, 32, 16, select_block, count, max_seqlen, torch.device("cuda", 0))


def test_score_capacity_is_a_power_of_two_covering_the_longest_sequence():
    assert score_capacity(1, 64) == 32
    assert score_capacity(64 * 32, 64) == 32 and score_capacity(64 * 32 + 1, 64) == 64
    assert score_capacity(65536, 64) == 1024 and score_capacity(65537, 64) == 2048
    assert score_capacity(1000, 7) == 256  # ceil(1000 / 7) = 143 blocks


def test_the_paper_shapes_are_served():
    assert why_unsupported_topk(problem()) == []
    assert why_unsupported_topk(problem(hq=32, hk=8, max_seqlen=131072)) == []
    assert config_of(problem()).shared_bytes() <= SHARED_BYTES


@pytest.mark.parametrize("kwargs,reason", [
    (dict(dtype=torch.float32), "float16/bfloat16"),
    (dict(d=72), "multiples of 16 up to 256"),
    (dict(d=320), "multiples of 16 up to 256"),
    (dict(hq=24, hk=2), "groups that divide 64"),
    (dict(count=33), "at most 32 blocks"),
    (dict(hq=8, hk=8, max_seqlen=65536), "shared memory"),  # 64 tokens a tile x 1024 scores
])
def test_what_it_refuses_says_why(kwargs, reason):
    reasons = why_unsupported_topk(problem(**kwargs))
    assert reasons and any(reason in r for r in reasons), reasons


def emulate_kernel(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, scale):
    """The kernel's walk in fp64, CTA by CTA as ``block_topk.py`` does it: token tiles and key
    tiles moved back to end at T and T_c, the key range from the first token's sequence start
    to the last token's last visible block, per-token sums per compressed key, each added to the
    selection blocks by ``add_staged``'s index bounds, then the warp ranking."""
    from fmha.kernels.common.block_topk import TILE_KEYS, TILE_ROWS

    tokens, hq, _ = q.shape
    hk = k_cmp.shape[1]
    g = hq // hk
    p_tile = TILE_ROWS // g
    cap = score_capacity(max((cu[1:] - cu[:-1]).tolist() + [1]), lsel)
    seq_of = torch.searchsorted(cu[1:].long(), torch.arange(tokens), right=True).clamp(max=len(cu) - 2)
    out = torch.full((tokens, hk, n), -99, dtype=torch.int32)
    keys = k_cmp.shape[0]
    top = 2.0 * g + 2.0
    for tile in range(-(-tokens // p_tile)):
        t0 = tile * p_tile
        t_start = min(t0, tokens - p_tile)
        ts = torch.arange(t_start, t_start + p_tile)
        b = seq_of[ts]
        pos = ts - cu[b].long()
        first = cu_cmp[b].long()
        seen = torch.where(pos + 1 >= l, (pos + 1 - l) // d + 1, 0)
        valid = (ts >= t0) & (ts < int(cu[-1]))  # padding rows are no token
        for h in range(hk):
            scores = torch.zeros(p_tile, cap, dtype=torch.float64)
            c_lo, c_hi = int(first[0]), min(int(first[-1] + seen[-1]), keys)
            for c_tile in range(c_lo, c_hi, TILE_KEYS):
                c_start = min(c_tile, keys - TILE_KEYS)
                c = torch.arange(c_start, c_start + TILE_KEYS)
                s = torch.einsum("pgd,cd->pgc", q[ts, h * g:(h + 1) * g].double(), k_cmp[c, h].double()) * scale
                local = c[None] - first[:, None]
                keep = (c[None] >= c_tile) & (local >= 0) & (local < torch.where(valid, seen, 0)[:, None])
                p = torch.exp(s - lse[h * g:(h + 1) * g, ts].double().T[:, :, None]).sum(1)
                staged = torch.where(keep, p, 0.0)
                span = (63 * d + l - 1) // lsel + 2
                for tok in range(p_tile):
                    i_start = c_start - int(first[tok])
                    for jo in range(span):
                        j = max(i_start, 0) * d // lsel + jo
                        x = j * lsel - l + 1
                        i_lo = (x + d - 1) // d if x > 0 else 0
                        n_lo, n_hi = max(i_lo - i_start, 0), min(((j + 1) * lsel - 1) // d - i_start, TILE_KEYS - 1)
                        if n_lo <= n_hi and j < cap and valid[tok]:
                            scores[tok, j] += staged[tok, n_lo:n_hi + 1].sum()
            for tok in range(p_tile):
                if not valid[tok]:
                    continue
                cur = int(pos[tok]) // lsel
                key = scores[tok, :cur + 1].clone()
                key[0], key[cur - 1 if cur else 0], key[cur] = top, 2 * top if cur else top, 3 * top
                chosen = sorted(range(cur + 1), key=lambda j: (-float(key[j]), j))[:n]
                out[ts[tok], h] = torch.tensor(sorted(chosen) + [-1] * (n - len(chosen)), dtype=torch.int32)
    return out


@pytest.mark.parametrize("lens,hq,hk,geometry", [
    ([130, 0, 1, 77], 16, 2, (32, 16, 64, 6)),
    ([300, 2], 4, 2, (16, 16, 16, 9)),
    ([5, 0, 3], 2, 2, (4, 2, 4, 2)),
    ([200, 64], 8, 8, (8, 4, 6, 4)),
])
def test_the_kernel_walk_emulated_gives_the_pytorch_lists(lens, hq, hk, geometry):
    """The tiling, key ranges and index bounds of the kernel, emulated in fp64 on the CPU, give
    the PyTorch path's lists (the GPU tests check the kernel itself)."""
    import fmha.nsa as nsa
    from fmha.nsa.topk import _select_blocks_torch

    l, d, lsel, n = geometry
    g = torch.Generator().manual_seed(sum(lens))
    total = sum(lens)
    q = torch.randn(total, hq, 16, generator=g, dtype=torch.float64)
    k = torch.randn(total, hk, 16, generator=g, dtype=torch.float64)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, d)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, d)
    rows = max(total, 64 // (hq // hk))  # the runner's padding
    pad = rows - total
    q_in = torch.cat([q, q.new_zeros(pad, hq, 16)])
    lse_in = torch.cat([lse, lse.new_full((hq, pad), float("-inf"))], 1)
    k_in = torch.cat([k_cmp, k_cmp.new_zeros(max(0, 64 - k_cmp.shape[0]), hk, 16)])
    got = emulate_kernel(q_in, k_in, lse_in, cu, cu_cmp, l, d, lsel, n, 0.25)[:total]
    want = _select_blocks_torch(q, k_cmp, lse, cu, cu_cmp, l, d, lsel, n, 0.25, max(lens))
    assert torch.equal(got, want)
