"""The Hopper backward's fp32 dQ accumulator laid out in the order of the MMA's fragments.

Each query tile of one query head owns ``tile_m * D`` consecutive floats: the dQ blocks of its two
consumer warpgroups (``dq_rows x dq_cols`` each, ``HopperBackwardConfig.dq_rows_per_warpgroup`` and
``dq_cols_per_warpgroup``), one after the other. Within a block, chunk ``k`` (``k < dq_cols / 8``)
of the warpgroup's thread ``t`` (0..127) is the 4 floats at ``(k * 128 + t) * 4``: the thread's
accumulator registers ``4k .. 4k + 3``, which hold rows ``r`` and ``r + 8``
(``r = 16 * (t // 32) + (t % 32) // 4``) of columns ``8k + 2 * (t % 4) + {0, 1}``. A warpgroup
stages its block with one 16-byte store per chunk and thread (conflict-free) and adds it to global
memory with one bulk reduce-add of contiguous bytes.

Dense: ``(B, H, query tiles, tile_m * D)``. Varlen: ``(H, tiles, tile_m * D)``, sequence ``b``'s
tiles starting at tile ``(cu_seqlens[b] + b * tile_m) // tile_m``, which keeps sequences' tiles
apart (``first_tile``). Rows past a sequence's end in its last tile are added into but never read.
The padding costs up to ``(B + 1) * tile_m`` rows of H * D floats over the packed rows' T (a batch
of many sequences much shorter than a tile pays most), as FA3's and FA4's varlen accumulators pad
each sequence too.
"""

import torch


def tile_floats(cfg) -> int:
    return cfg.tile_m * cfg.head_dim


def first_tile(offset_q, batch, tile_m: int):
    """Varlen: the accumulator tile where sequence ``batch`` (first row ``offset_q`` of the packed
    rows) starts (plain arithmetic: the kernels call it on their values too). Sequence b's last tile is below b + 1's first: floor((x + L) / t) + 1 >=
    floor(x / t) + ceil(L / t) for x = cu[b] + b t and L its length."""
    return (offset_q + batch * tile_m) // tile_m


def varlen_tiles(total_q: int, batch: int, tile_m: int) -> int:
    """Varlen: tiles of the accumulator per head (the last sequence's last tile index is at most
    total_q // tile_m + batch)."""
    return total_q // tile_m + batch + 1


def allocate(cfg, q: torch.Tensor, batch: int, heads: int, seqlen_q: int, zeroed: bool = True) -> torch.Tensor:
    """The accumulator for ``q`` ((B, S, H, D), or varlen (T, H, D) with ``batch`` sequences);
    zeroed, or left for the row pass to zero."""
    if cfg.varlen:
        shape = (heads, varlen_tiles(q.shape[0], batch, cfg.tile_m), tile_floats(cfg))
    else:
        shape = (batch, heads, -(-seqlen_q // cfg.tile_m), tile_floats(cfg))
    return (torch.zeros if zeroed else torch.empty)(shape, dtype=torch.float32, device=q.device)


def tile_rows(acc: torch.Tensor, cfg) -> torch.Tensor:
    """The accumulator as (..., tiles * tile_m, D) rows in order (a copy)."""
    d, rows, cols = cfg.head_dim, cfg.dq_rows_per_warpgroup, cfg.dq_cols_per_warpgroup
    lead = acc.shape[:-1]
    n = len(lead)
    # (block, chunk, warp, MMA row in 8, column pair, row half, column in pair); the MMA's rows are
    # 4 warps x 16, its columns chunks x 8
    blk, k, w, r8, q, h, e = range(n, n + 7)
    if cfg.dq_transposed:  # the MMA's rows are the block's half of the head dim, its columns the tile's rows
        order, chunks = (k, q, e, blk, w, h, r8), rows // 8
    elif cfg.dq_split_rows:  # block = which 64 of the tile's rows
        order, chunks = (blk, w, h, r8, k, q, e), cols // 8
    else:  # block = which half of the head dim
        order, chunks = (w, h, r8, blk, k, q, e), cols // 8
    frag = acc.view(*lead, 2, chunks, 4, 8, 4, 2, 2).permute(*range(n), *order)
    return frag.reshape(*lead[:-1], lead[-1] * cfg.tile_m, d)


def copy_to_dq(acc: torch.Tensor, dq: torch.Tensor, cfg, cu_seqlens_q=None):
    """dq (q's dtype, (B, S, H, D) or varlen (T, H, D)) = the accumulator's rows, by torch ops:
    the reference of the conversion kernel (``dq_convert.py``). Varlen: each packed row's place in
    the accumulator is computed on the device (no read of the offsets)."""
    rows = tile_rows(acc, cfg)
    if not cfg.varlen:
        dq.copy_(rows[:, :, :dq.shape[1]].permute(0, 2, 1, 3))
        return
    total = dq.shape[0]
    r = torch.arange(total, device=dq.device, dtype=cu_seqlens_q.dtype)
    seq = torch.searchsorted(cu_seqlens_q[1:], r, right=True)
    start = cu_seqlens_q[seq]
    padded = first_tile(start, seq, cfg.tile_m) * cfg.tile_m + (r - start)
    dq.copy_(rows[:, padded.long()].permute(1, 0, 2))
