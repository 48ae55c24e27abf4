"""The fragment-ordered dQ accumulator (``fmha/kernels/hopper/dq_layout.py``), on CPU: its rows
against a model of the Hopper MMA's accumulator fragments, and the varlen tiles' placement."""

import random

import pytest
import torch

from fmha.kernels.hopper import dq_layout
from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
from fmha.masking import MaskKind


def _cfg(head_dim, varlen=False, tile_m=None):
    cfg = HopperBackwardConfig(torch.bfloat16, head_dim, MaskKind.NONE, False, False, False, varlen=varlen)
    if tile_m is not None:  # the 80-row tile of lab variant fmha_bwd_m80
        from lab.variants import backward_variant_config

        cfg = backward_variant_config(cfg, tile_m=tile_m)
    return cfg


def _fragment_position(t: int, v: int) -> tuple:
    """(row, column) of register ``v`` of warpgroup thread ``t`` in an m64 wgmma accumulator
    (PTX ISA, the wgmma D fragment): column pairs, then the row 8 below, then the next 8 columns."""
    return 16 * (t // 32) + (t % 32) // 4 + 8 * ((v // 2) % 2), 8 * (v // 4) + 2 * (t % 4) + v % 2


def _stage_like_the_kernel(tile: torch.Tensor, cfg) -> torch.Tensor:
    """A tile's floats as the two consumer warpgroups stage them: thread t's registers 4k..4k+3 at
    (k * 128 + t) * 4 of its warpgroup's block."""
    rows, cols = cfg.dq_rows_per_warpgroup, cfg.dq_cols_per_warpgroup
    flat = torch.full((cfg.tile_m * cfg.head_dim,), float("nan"))
    for wg in range(2):
        for t in range(128):
            for v in range(rows * cols // 128):
                r, c = _fragment_position(t, v)
                if cfg.dq_transposed:  # dQ^T: the MMA's rows are head dims, its columns query rows
                    row, col = c, wg * cols + r
                else:
                    row, col = (wg * rows + r, c) if cfg.dq_split_rows else (r, wg * cols + c)
                flat[wg * rows * cols + ((v // 4) * 128 + t) * 4 + v % 4] = tile[row, col]
    return flat


@pytest.mark.parametrize("head_dim,tile_m", [(32, None), (64, None), (128, None), (128, 80)])
def test_tile_rows_undo_the_staging_order(head_dim, tile_m):
    cfg = _cfg(head_dim, tile_m=tile_m)
    tiles = torch.randn(2, 3, cfg.tile_m, head_dim)  # (heads, tiles, rows, D)
    acc = torch.stack([torch.stack([_stage_like_the_kernel(t, cfg) for t in h]) for h in tiles])
    assert not acc.isnan().any()  # every float of the tile is some thread's register
    assert torch.equal(dq_layout.tile_rows(acc, cfg), tiles.reshape(2, 3 * cfg.tile_m, head_dim))


@pytest.mark.parametrize("head_dim,tile_m", [(64, None), (128, None), (128, 80)])
def test_dense_copy_to_dq(head_dim, tile_m):
    cfg = _cfg(head_dim, tile_m=tile_m)
    batch, seqlen, heads = 2, 2 * cfg.tile_m - 5, 3
    q = torch.empty(batch, seqlen, heads, head_dim)
    acc = dq_layout.allocate(cfg, q, batch, heads, seqlen)
    assert acc.shape == (batch, heads, 2, cfg.tile_m * head_dim) and not acc.any()
    rows = torch.randn(batch, heads, 2 * cfg.tile_m, head_dim)
    for b in range(batch):
        for h in range(heads):
            for m in range(2):
                acc[b, h, m] = _stage_like_the_kernel(rows[b, h, m * cfg.tile_m:(m + 1) * cfg.tile_m], cfg)
    dq = torch.empty_like(q)
    dq_layout.copy_to_dq(acc, dq, cfg)
    assert torch.equal(dq, rows[:, :, :seqlen].permute(0, 2, 1, 3))


def test_varlen_sequences_own_separate_tiles():
    """Every sequence's rows land in tiles of their own, inside the allocation, and the copy back
    reads each packed row from its own place (empty and one-row sequences included)."""
    rng = random.Random(0)
    for head_dim, tile_m in ((64, None), (128, None), (128, 80)):
        cfg = _cfg(head_dim, varlen=True, tile_m=tile_m)
        for _ in range(8):
            lengths = [rng.choice([0, 1, rng.randrange(1, 300)]) for _ in range(rng.randrange(1, 7))]
            cu = [0]
            for n in lengths:
                cu.append(cu[-1] + n)
            total, tiles = cu[-1], dq_layout.varlen_tiles(cu[-1], len(lengths), cfg.tile_m)
            owner = {}
            for b, n in enumerate(lengths):
                first = dq_layout.first_tile(cu[b], b, cfg.tile_m)
                for t in range(first, first + -(-n // cfg.tile_m)):
                    assert t < tiles and owner.setdefault(t, b) == b
            heads = 2
            rows = torch.randn(heads, tiles * cfg.tile_m, head_dim)
            acc = torch.stack([torch.stack([_stage_like_the_kernel(rows[h, t * cfg.tile_m:(t + 1) * cfg.tile_m], cfg)
                                            for t in range(tiles)]) for h in range(heads)])
            dq = torch.empty(total, heads, head_dim)
            dq_layout.copy_to_dq(acc, dq, cfg, torch.tensor(cu, dtype=torch.int32))
            for b, n in enumerate(lengths):
                start = dq_layout.first_tile(cu[b], b, cfg.tile_m) * cfg.tile_m
                assert torch.equal(dq[cu[b]:cu[b] + n], rows[:, start:start + n].permute(1, 0, 2))


@pytest.mark.parametrize("head_dim,tile_m", [(32, None), (64, None), (128, None), (128, 80)])
@pytest.mark.parametrize("varlen", [False, True])
def test_the_row_pass_zeroes_every_value_the_conversion_reads(head_dim, tile_m, varlen):
    """``backward_rows.tile_rows_zeroed`` (what the row pass zeroes, row by row, in contiguous
    spans that ignore the fragments' order): replayed on a NaN-filled accumulator, every value the
    conversion reads for a real row is zeroed, with lengths that are not multiples of the tile,
    and empty and one-row sequences."""
    from fmha.kernels.common.backward_rows import tile_rows_zeroed

    cfg = _cfg(head_dim, varlen=varlen, tile_m=tile_m)
    tm, heads = cfg.tile_m, 2
    if varlen:
        lengths = [0, 1, tm, 3 * tm + 7, 0, tm - 1, 1, 2 * tm + 1]
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        q = torch.empty(int(cu[-1]), heads, head_dim)
        seqs = [(b, int(cu[b]), n) for b, n in enumerate(lengths)]
        batch, seqlen = len(lengths), None
    else:
        batch, seqlen = 3, 2 * tm + 5
        q = torch.empty(batch, seqlen, heads, head_dim)
        seqs = [(b, 0, seqlen) for b in range(batch)]

    def converted(tails: bool) -> torch.Tensor:
        acc = dq_layout.allocate(cfg, q, batch, heads, seqlen, zeroed=False).fill_(float("nan"))
        spans = acc.view(*acc.shape[:-1], tm, head_dim)  # a tile as tm spans of D floats
        for b, start, n in seqs:
            for row in range(n):
                padded = (dq_layout.first_tile(start, b, tm) * tm if varlen else 0) + row
                first, stop = tile_rows_zeroed(padded % tm, int(tails and row == n - 1), tm)
                tile = spans[:, padded // tm] if varlen else spans[b, :, padded // tm]
                tile[..., first:stop, :] = 0.0
        dq = torch.full_like(q, float("nan"))
        dq_layout.copy_to_dq(acc, dq, cfg, cu if varlen else None)
        return dq

    assert not converted(tails=True).isnan().any()
    # without the last rows' tails the fragments' order puts real rows' values in spans no row zeroes
    assert converted(tails=False).isnan().any()
