"""Block-sparse masks: which (query block, key block) pairs of each (batch, head) attention
computes, and which of them need ``mask_mod`` per element (docs/semantics.md, "Programmable
attention").

A ``BlockMask`` holds one state per block: skipped, partial (``mask_mod`` decides per element) or
full (every element kept, ``mask_mod`` not called). ``create_block_mask`` builds one on the
device by evaluating a ``mask_mod`` over the whole grid; ``BlockMask.from_flex`` converts PyTorch
FlexAttention's. A kernel reads it at its own tile sizes (``tile_lists``): per query tile (or,
for the backward, per key tile) the partial tiles then the full ones, built with tensor ops on
the device, without a host sync, and kept on the object for the next call.
"""

from __future__ import annotations

import math
import weakref
from typing import Optional, Tuple

import torch

from .mods import MASK, ModFunction, call_mask_mod

__all__ = ["BlockMask", "create_block_mask", "SKIPPED", "PARTIAL", "FULL"]

SKIPPED, PARTIAL, FULL = 0, 1, 2
_BY_STATES = weakref.WeakValueDictionary()
#: elements of one evaluation chunk of ``create_block_mask``
_CHUNK_ELEMENTS = 1 << 26


class BlockMask:
    """Block states ``states`` (B or 1, H or 1, ceil(Q_LEN / block_q), ceil(KV_LEN / block_k)),
    uint8 ``SKIPPED``/``PARTIAL``/``FULL``, on the device of the attention call; a size-1 batch or
    head dim applies to every batch entry or head. ``mask_mod`` (optional) is the mask the partial
    blocks use when the call gives none."""

    def __init__(self, states: torch.Tensor, block_size: Tuple[int, int], seq_lengths: Tuple[int, int],
                 mask_mod=None, aux: tuple = ()):
        if not isinstance(states, torch.Tensor) or states.dim() != 4:
            raise ValueError("BlockMask states must be a 4-d tensor (B, H, query blocks, key blocks)")
        bq, bk = (int(x) for x in block_size)
        q_len, kv_len = (int(x) for x in seq_lengths)
        if bq <= 0 or bk <= 0:
            raise ValueError(f"block sizes must be positive, got {block_size}")
        expect = (-(-q_len // bq), -(-kv_len // bk))
        if tuple(states.shape[2:]) != expect:
            raise ValueError(f"BlockMask states have {tuple(states.shape[2:])} blocks; {q_len} x {kv_len} in blocks "
                             f"of {bq} x {bk} needs {expect}")
        self.states = states.to(torch.uint8)
        self.block_size = (bq, bk)
        self.seq_lengths = (q_len, kv_len)
        self.mask_mod = ModFunction.check(mask_mod, MASK) if not isinstance(mask_mod, ModFunction) else mask_mod
        self.aux = tuple(aux)
        self._lists = {}
        _BY_STATES[id(self.states)] = self

    @staticmethod
    def of_states(states: torch.Tensor, geometry) -> "BlockMask":
        """The BlockMask whose ``states`` these are (the custom ops hold only the tensor), or a new
        one over them; ``geometry`` is (block_q, block_k, Q_LEN, KV_LEN)."""
        known = _BY_STATES.get(id(states))
        if known is not None and known.states is states:
            return known
        return BlockMask(states, tuple(geometry[:2]), tuple(geometry[2:]))

    def __repr__(self):
        b, h, nq, nk = self.states.shape
        return (f"BlockMask(B={b}, H={h}, {self.seq_lengths[0]} x {self.seq_lengths[1]} in {nq} x {nk} blocks of "
                f"{self.block_size[0]} x {self.block_size[1]})")

    @property
    def shape(self):
        return tuple(self.states.shape[:2]) + self.seq_lengths

    def sparsity(self) -> float:
        """The fraction of blocks skipped (a device sync)."""
        return float((self.states == SKIPPED).float().mean())

    @staticmethod
    def from_flex(flex) -> "BlockMask":
        """A PyTorch FlexAttention ``BlockMask`` (``torch.nn.attention.flex_attention``): its
        partial blocks (``kv_indices``) and full ones (``full_kv_indices``), same geometry, its
        ``mask_mod``."""
        num, idx = flex.kv_num_blocks, flex.kv_indices
        b, h, nq = num.shape
        q_len, kv_len = flex.seq_lengths
        bq, bk = flex.BLOCK_SIZE
        nk = -(-kv_len // bk)
        states = torch.zeros((b, h, nq, nk + 1), dtype=torch.uint8, device=num.device)

        def mark(count, indices, value):
            listed = torch.arange(indices.shape[-1], device=num.device) < count[..., None]
            # unlisted entries go to the spare last column, dropped below
            cols = torch.where(listed, indices.long(), nk)
            states.scatter_(3, cols, torch.where(listed, value, states.gather(3, cols)).to(torch.uint8))

        mark(num, idx, PARTIAL)
        if flex.full_kv_num_blocks is not None:
            mark(flex.full_kv_num_blocks, flex.full_kv_indices, FULL)
        states = states[..., :nk]
        nq_needed = -(-q_len // bq)
        mask_mod = getattr(flex, "mask_mod", None)
        if mask_mod is not None and getattr(mask_mod, "__name__", "") == "noop_mask":
            mask_mod = None
        return BlockMask(states[:, :, :nq_needed].contiguous(), (bq, bk), (q_len, kv_len), mask_mod)

    # ---- the kernels' view

    def tile_states(self, tile_m: int, tile_n: int) -> torch.Tensor:
        """The states at tiles of ``tile_m`` x ``tile_n``: a tile is skipped where all its blocks
        are, full where all are (and its keys do not run past KV_LEN: the kernel masks those),
        partial otherwise. Elements past the sequences count as neither."""
        bq, bk = self.block_size
        q_len, kv_len = self.seq_lengths
        gq, gk = math.gcd(bq, tile_m), math.gcd(bk, tile_n)
        fine = self.states.repeat_interleave(bq // gq, dim=2).repeat_interleave(bk // gk, dim=3)
        fine = fine[:, :, :-(-q_len // gq), :-(-kv_len // gk)]
        mq, nk = -(-q_len // tile_m), -(-kv_len // tile_n)
        pad = (0, nk * (tile_n // gk) - fine.shape[3], 0, mq * (tile_m // gq) - fine.shape[2])

        def all_over_tiles(flags):
            flags = torch.nn.functional.pad(flags, pad, value=True)
            b, h = flags.shape[:2]
            return flags.view(b, h, mq, tile_m // gq, nk, tile_n // gk).all(dim=5).all(dim=3)

        empty, full = all_over_tiles(fine == SKIPPED), all_over_tiles(fine == FULL)
        if kv_len % tile_n:
            full[..., -1] = False
        return torch.where(empty, SKIPPED, torch.where(full, FULL, PARTIAL)).to(torch.uint8)

    def tile_lists(self, tile_m: int, tile_n: int, transposed: bool = False):
        """``(counts, indices)`` int32 for a kernel's walk: per (b, h, query tile) (``transposed``:
        per key tile) ``counts[..., 0]`` partial and ``counts[..., 1]`` full tiles, listed in
        ``indices[..., :]`` partial first, each part ascending."""
        key = (tile_m, tile_n, transposed)
        if key not in self._lists:
            st = self.tile_states(tile_m, tile_n)
            if transposed:
                st = st.transpose(2, 3)
            order = torch.where(st == PARTIAL, 0, torch.where(st == FULL, 1, 2)).to(torch.int64)
            n = st.shape[-1]
            rank = order * n + torch.arange(n, device=st.device)
            indices = rank.argsort(dim=-1).to(torch.int32).contiguous()
            counts = torch.stack(((st == PARTIAL).sum(-1), (st == FULL).sum(-1)), dim=-1).to(torch.int32).contiguous()
            self._lists[key] = (counts, indices)
        return self._lists[key]

    def element_keep(self, rows: torch.Tensor, cols: torch.Tensor, b: int, heads: torch.Tensor):
        """(states at each (head, row, col), as (heads, rows, cols)): for the reference."""
        bq, bk = self.block_size
        st = self.states[b if self.states.shape[0] > 1 else 0]
        st = st[heads if st.shape[0] > 1 else torch.zeros_like(heads)]
        return st[:, (rows // bq)[:, None], (cols // bk)[None, :]]


def create_block_mask(mask_mod, B: Optional[int], H: Optional[int], Q_LEN: int, KV_LEN: int, device="cuda",
                      BLOCK_SIZE=128, aux=None) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` (``mask_mod(b, h, q_idx, kv_idx[, aux])``, fmha.mods),
    evaluated on ``device`` over every (query, key) pair: blocks it keeps whole are full, blocks
    it keeps nothing of are skipped. ``B``/``H`` None: the mask does not depend on them (one entry
    serves all). ``BLOCK_SIZE``: an int or (query, key) block sizes. FlexAttention's
    ``create_block_mask`` signature."""
    mod = ModFunction.check(mask_mod, MASK)
    if mod is None:
        raise TypeError("create_block_mask needs a mask_mod")
    bq, bk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else BLOCK_SIZE
    aux = () if aux is None else tuple(aux) if isinstance(aux, (tuple, list)) else (aux,)
    nb, nh = B or 1, H or 1
    q_len, kv_len = int(Q_LEN), int(KV_LEN)
    nq, nk = -(-q_len // bq), -(-kv_len // bk)
    states = torch.empty((nb, nh, nq, nk), dtype=torch.uint8, device=device)
    b = torch.arange(nb, device=device).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, nh, 1, 1)
    kv = torch.arange(nk * bk, device=device).view(1, 1, 1, -1)
    kv_in = kv < kv_len
    rows_per_chunk = max(bq, _CHUNK_ELEMENTS // max(nb * nh * nk * bk, 1) // bq * bq)
    for r0 in range(0, nq * bq, rows_per_chunk):
        r1 = min(r0 + rows_per_chunk, nq * bq)
        q = torch.arange(r0, r1, device=device).view(1, 1, -1, 1)
        inside = (q < q_len) & kv_in
        keep = call_mask_mod(mod, mod.fn, b, h, q.clamp(max=q_len - 1), kv.clamp(max=kv_len - 1), aux)
        keep = torch.as_tensor(keep, device=device).expand(nb, nh, r1 - r0, nk * bk)
        blocks = (nb, nh, (r1 - r0) // bq, bq, nk, bk)
        kept = (keep & inside).view(blocks).any(dim=5).any(dim=3)
        whole = (keep | ~inside).view(blocks).all(dim=5).all(dim=3)
        states[:, :, r0 // bq:r1 // bq] = torch.where(whole, FULL, torch.where(kept, PARTIAL, SKIPPED))
    return BlockMask(states, (bq, bk), (q_len, kv_len), mod, aux)
