"""Hopper (SM90) attention backward: dK and dV per K/V tile, dQ accumulated in fp32.

One CTA owns one K/V tile (128 keys of one K/V head of one sequence; 64 with ``split_head_dim``) and keeps its
dK and dV in registers while it walks every query tile (``tile_m`` rows) of every query head of
the group whose mask keeps some key of the tile. Roles:

* warp 0 of warpgroup 0, the **producer**: TMA-loads K and V once, then each query tile's Q,
  dO, LSE (log2) and delta rows into a two-stage ring (one stage at D=256).
* warp 1 of warpgroup 0, the **dQ writer**: adds each warpgroup's block of a query tile's dQ,
  staged in shared memory in the MMA fragments' order (``dq_layout.py``), into the fp32
  accumulator by one bulk reduce-add of contiguous bytes (asynchronous, instead of per-element
  atomics) and frees the block once the add has read it.
* warpgroups 1 and 2, the **consumers** (``bwd_consumer.py``), 64 keys each. Per query tile, with S^T = K Q^T and
  dP^T = V dO^T on the tensor cores (keys as the M dimension, so that P^T and dS^T land in
  registers in the A-operand order of the next products):
  P^T = exp2(S^T * scale_log2 - lse_log2) while dP^T is computed, then
  dS^T = P^T * (dP^T * out_scale - delta) (bf16: times the score scale); dV += P^T dO and dK += dS^T Q from
  registers; dS^T is also stored to shared memory (two buffers, alternating with the stages),
  where both warpgroups read all 128 keys of it for dQ = dS K, each warpgroup half of the head
  dim (at D=64, with 128-row query tiles, ``dq_split_rows``: its 64 query rows over the whole
  head dim; at D=128 with 80-row tiles, ``dq_transposed``: dQ^T = K^T dS^T, its half of the head
  dim as M), which it stages for the writer. At the end dK and dV go from registers to global
  memory, or at D=128 (``dkv_store_tma``) through the freed K and V buffers by TMA stores.
* D + D_v > 256 (``split_head_dim``): both consumer warpgroups hold all 64 keys, each over its half of
  the head dim; S^T and dP^T are split by query columns instead (64 keys x 32 queries each), and
  P^T and dS^T go through shared memory, from where both warpgroups' dV, dK and dQ products read
  them. dV and dK are issued before dQ and release the one Q/dO stage once done, so the next
  tile's loads run under dQ's product; dS^T alternates between two buffers by tile parity (the
  other warpgroup's dQ may still read the last tile's), P^T has a third.

Before it, a row pass (``kernels/common/backward_rows.py``) turns the LSE into log2 units (+inf
for rows that keep nothing, so their P is 0) and computes delta = (rowsum(dO * O) - dLSE) *
score_scale for bf16, so that dS carries the score scale and neither dQ nor dK is rescaled
(fp16 rounds dS unscaled and scales dQ and dK in fp32: ``ds_prescaled``); dQ is
converted to the input's type afterwards. The K/V tile's query range and which query tiles need
the element-wise mask come from the same row bands as the forward's
(``fmha.masking.row_key_bounds``).

``deterministic``: the dQ reduce-adds of one query tile happen in K/V tile order. A semaphore
per (sequence, query head, query tile) holds one past the last K/V tile that added; each CTA waits
for its predecessor's value before adding and publishes its own once its add has completed. The
K/V tiles that add into a query tile are consecutive (the mask's row bands move right by at most
one key per row and never have gaps), so the predecessor of tile n is n - 1 unless n is the first.
CTAs wait only on CTAs of lower block index, which the GPU starts first. NSA selection: the K/V
tiles that add into a query tile are any of its sequence's, so each list entry carries its turn
(its rank by K/V tile among them) and the tiles are listed in sequence order; a split list's
shares add their dK and dV in share order, each share after the one before it
(``selection_visits.selection_backward_order``).

NSA selection (``cfg.select_block``, ``bwd_config.selection_backward_config``) is this kernel over
a varlen batch of packed GQA rows (each sequence's tokens times the group's heads as rows of one
K/V head, ``rows_per_query`` of them per position), its K/V tiles listed on the device: each
walks the query tiles that chose one of its blocks (``SelectedQueryVisits``, built by
``fmha.nsa.selection_visits.selection_backward_visits``), and each consumer warpgroup masks its
64 keys by its visit's positions (``FragmentMask.apply_selected_transposed``).

Varlen (packed THD) batches move every tile through per-sequence TMA descriptors
(``sequence_descriptors.py``): loads past a sequence's end read zeros. The fragment-ordered dQ
accumulator keeps each sequence's tiles apart, so a ragged query tile's add lands in rows that
the conversion never reads. The
LSE and delta rows go through the packed tensor's own descriptor; a ragged tile's rows past its
sequence get P = 0 and delta = 0 in the consumers.
"""

from dataclasses import dataclass
from typing import Any, Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from ..common import sequence_descriptors as seq_desc
from ..common.layouts import bshd_to_sdhb, mma_operand_smem_layout, rows_first
from ..common.device_tile_list import COST_BINS, DeviceWorkTileList, cost_bins_bytes
from ..common.kv_walk import query_walk
from ..common.seqinfo import SequenceInfo
from ..common.tma import bulk_reduce_add_f32, tma_tiles
from . import dq_layout
from .barriers import NamedBarrierBwd
from .bwd_consumer import ROW_ALIGN, BackwardConsumer
from .config import SMEM_LIMIT
from .bwd_config import HopperBackwardConfig
from .epilogue import wg_slice_layout
from .wgmma import WARPGROUP_THREADS as _WG


@dataclass(frozen=True)
class QueryVisits:
    """The query tiles a K/V tile visits for each query head: the range the mask's walk gives
    (``query_tiles``; the same for every head), or a block mask's list entry of the head
    (``mBlockLists``: partial tiles, then full ones)."""

    m_start: Any
    m_end: Any
    lists: Any
    batch: Any
    n_block: Any
    #: from the last down (the deterministic dQ order, ``tile_at``)
    descending: bool

    def range(self, head):
        """[start, end) of the steps for query head ``head``."""
        if const_expr(self.lists is not None):
            counts = self.lists[0]
            return Int32(0), counts[self.batch, head, self.n_block, 0] + counts[self.batch, head, self.n_block, 1]
        return self.m_start, self.m_end

    @cute.jit
    def total(self, head_kv, group):
        """Steps over every query head of K/V head ``head_kv``'s group."""
        if const_expr(self.lists is not None):
            count = Int32(0)
            for g in cutlass.range(group, unroll=1):
                start, end = self.range(head_kv * group + g)
                count += end - start
            return count
        return group * (self.m_end - self.m_start)

    def tile_at(self, i, head):
        """The query tile of step ``i``. Deterministic: from the last down, so that under causal
        masks every K/V tile starts on the same query tile and each waits for its predecessor's
        add of that tile only briefly; walking up, K/V tile n would start on query tile n, which
        tile n - 1 reaches second, and the waits would add up along the diagonal."""
        if const_expr(self.lists is not None):
            return self.lists[1][self.batch, head, self.n_block, i]
        if const_expr(self.descending):
            return self.m_end - 1 - (i - self.m_start)
        return i

    def partial(self, i, head):
        """Whether step ``i`` is a block mask's partial tile (listed visits only)."""
        return i < self.lists[0][self.batch, head, self.n_block, 0]


@dataclass(frozen=True)
class SelectedQueryVisits:
    """NSA selection (``cfg.select_block``): the query tiles listed for a K/V tile
    (``fmha.nsa.selection_visits.selection_backward_visits``): K/V tile ``n_block`` of sequence
    ``batch`` is chunk ``chunk_base[batch] + n_block``; its entries of head h are ``offsets[h *
    chunks + chunk]`` up to the next offset, those before ``masked_end`` masked, each a query tile
    (``tiles``) and, per consumer warpgroup, its query positions that chose the block holding that
    warpgroup's keys (``positions``). A list is cut into ``pieces`` equal shares, one per CTA;
    this CTA walks share ``piece``, and where the list is cut adds its dK and dV into the fp32
    accumulators (``dkv_partials``). ``deterministic``: each entry's turn among the K/V tiles that
    add into its query tile (``turn``), and a counter per list and warpgroup of the shares that
    have added dK and dV (``dkv_turn``; ``selection_visits.selection_backward_order``)."""

    lists: Any
    batch: Any
    n_block: Any
    num_heads_kv: Any
    piece: Any

    def _list(self, head):
        chunk_base, masked_end = self.lists[0], self.lists[2]
        chunks = masked_end.shape[0] // self.num_heads_kv
        return head * chunks + cutlass.min(chunk_base[self.batch] + self.n_block, chunks - 1)

    def range(self, head):
        at = self._list(head)
        start, end = self.lists[1][at], self.lists[1][at + 1]
        pieces = self.lists[5][at]
        share = (end - start + pieces - 1) // pieces
        first = cutlass.min(start + self.piece * share, end)
        return first, cutlass.min(first + share, end)

    def has_work(self, head):
        """Share 0 always runs (it writes dK and dV of keys no query chose); the others where
        they hold entries."""
        start, end = self.range(head)
        return (self.piece == 0) | (start < end)

    def split(self, head):
        return self.lists[5][self._list(head)] > 1

    def dkv_partials(self):
        """The fp32 dK and dV accumulators ((T, H_k, D), zeroed) that a split list's CTAs add into."""
        return self.lists[6], self.lists[7]

    @cute.jit
    def total(self, head_kv, group):
        count = Int32(0)
        for g in cutlass.range(group, unroll=1):
            start, end = self.range(head_kv * group + g)
            count += end - start
        return count

    def tile_at(self, i, head):
        return self.lists[3][i]

    def partial(self, i, head):
        return i < self.lists[2][self._list(head)]

    def positions(self, i, warpgroup):
        return self.lists[4][i, warpgroup]

    def turn(self, i):
        """Deterministic: how many K/V tiles add into entry ``i``'s query tile before this one."""
        return self.lists[8][i]

    def dkv_turn(self, head, warpgroup):
        """Deterministic: the address of the counter of this list's shares that have added the dK
        and dV of ``warpgroup``'s keys; share ``piece`` adds when it reads ``piece``."""
        turns = self.lists[9]
        return turns.iterator + cute.crd2idx(self._list(head) * 2 + warpgroup, turns.layout)


class HopperAttentionBackward(BackwardConsumer, DeviceWorkTileList):
    def __init__(self, cfg: HopperBackwardConfig):
        if cfg.dq_split_rows and cfg.tile_m != 2 * 64:
            raise ValueError(f"dq_split_rows gives each consumer warpgroup 64 query rows of dQ: it needs tile_m = 128, "
                             f"got {cfg.tile_m}")
        if cfg.dq_transposed and cfg.dq_cols_per_warpgroup != 64:
            raise ValueError(f"dQ^T takes each warpgroup's half of the head dim as the MMA's 64 rows: a {cfg.tile_m}-row "
                             f"query tile needs head_dim 128, got {cfg.head_dim}")
        self.cfg = cfg
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.row_box = cfg.tile_m + ROW_ALIGN
        self.num_threads = _WG * 3

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor, mLSE2: cute.Tensor,
                 mDelta: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqDescriptors: Optional[cute.Tensor], mErrors: Optional[cute.Tensor],
                 mSemaphores: Optional[cute.Tensor], mTileTable: Optional[cute.Tensor],
                 mTileCount: Optional[cute.Tensor], mModTensors: Optional[tuple], mBlockLists: Optional[tuple],
                 max_seqlen_q: Int32, max_seqlen_k: Int32,
                 scale_log2: Float32, out_scale: Float32, score_scale: Float32, softcap_factor: Optional[Float32],
                 window_left: Optional[Int32], window_right: Optional[Int32], stream: cuda.CUstream):
        """Dense tensors: q/dO (B, S_q, H_q, D), k/v/dK/dV (B, S_k, H_k, D), LSE2/delta
        (B, H_q, S) fp32 with S >= S_q a multiple of 4 (rows past S_q are never used), dQacc
        the fragment-ordered accumulator (``dq_layout.py``; zeroed). Varlen: (T, H, D) rows,
        LSE2/delta (1, H_q, T) with T >= T_q a multiple of 4, cu_seqlens (B + 1,) and room for
        ``cfg.sequence_descriptors`` per sequence (B, 4 or 6, 16) int64; ``tiles_listed``: the (sequence, K/V tile) table (N, 2) int32, costliest first
        (``fmha.work_tiles.kv_work_tile_table``), and with ``tiles_on_device`` room for it and its
        count (1,) int32, filled by the launch. ``deterministic``: semaphores (B, H_q, query tiles)
        int32, zeroed. delta comes
        multiplied by ``score_scale`` when ``cfg.ds_prescaled``, so that dS is too and dQ and dK
        need no scaling of their own. ``softcap_factor`` (``cfg.softcap``): the raw q.k's factor
        before tanh, ``scale_log2`` then the cap's (``fmha.kernels.common.mask``)."""
        cfg = self.cfg
        varlen = cfg.varlen
        self.dtype = mQ.element_type
        d, d_v, tile_m, tile_n = cfg.head_dim, cfg.head_dim_v, self.tile_m, self.tile_n
        q, k, v, do = (bshd_to_sdhb(t, varlen) for t in (mQ, mK, mV, mdO))
        lse2, delta = (rows_first(t) for t in (mLSE2, mDelta))
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        if const_expr(cfg.split_head_dim):
            # S^T = K Q^T and dP^T = V dO^T: M = all 64 keys, N = the warpgroup's half of the queries
            mma_sdp = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                       (1, 2, 1), (64, tile_m // 2))
            # dV += P^T dO, dK += dS^T Q: A (P^T, dS^T) from shared memory, M = keys, N = the
            # warpgroup's half of the head dim, K = queries
            mma_dkv = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                       (1, 2, 1), (64, d // 2))
            mma_dv = mma_dkv if const_expr(d_v == d) else sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, d_v // 2))
        else:
            # S^T = K Q^T and dP^T = V dO^T: M = keys (64 per warpgroup), N = queries, K = head dim
            mma_sdp = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                       (2, 1, 1), (64, tile_m))
            # dV += P^T dO, dK += dS^T Q: A from registers, M = keys, N = head dim, K = queries
            mma_dkv = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                       (2, 1, 1), (64, d), warpgroup.OperandSource.RMEM)
            mma_dv = mma_dkv if const_expr(d_v == d) else sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (64, d_v), warpgroup.OperandSource.RMEM)
        # dQ = dS K, one warpgroup per half of the head dim (or of the query rows,
        # ``dq_split_rows``): M = queries, N = head dim, K = keys. ``dq_transposed``: dQ^T = K^T dS^T,
        # M = the warpgroup's half of the head dim, N = queries
        dq_m, dq_n = cfg.dq_rows_per_warpgroup, cfg.dq_cols_per_warpgroup
        mma_dq = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 1, 1),
                                                  (64, dq_m if cfg.dq_transposed else dq_n))
        # the products that read a warpgroup's half of the head dim (dQ's K, and with
        # ``split_head_dim`` dK's Q and dV's dO) need each half to start on a swizzle atom
        atom_cols, atom_cols_v = (x if x <= 64 else x // 2 for x in (d, d_v))
        sQ_layout = mma_operand_smem_layout("b", LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d), self.dtype, cfg.q_stages,
                                            atom_cols)
        sK_layout = mma_operand_smem_layout("a", LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d), self.dtype, 1, atom_cols)
        # dO and V: the same layouts over V's head dim
        sdO_layout = mma_operand_smem_layout("b", LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d_v), self.dtype,
                                             cfg.q_stages, atom_cols_v)
        sV_layout = mma_operand_smem_layout("a", LayoutEnum.ROW_MAJOR, (tile_n, tile_m, d_v), self.dtype, 1,
                                            atom_cols_v)
        # dS^T double-buffered with the Q/dO stages: a warpgroup may write the next tile's while
        # the other still reads this one's. ``split_head_dim`` (one Q/dO stage): buffers 0 and 1
        # hold dS^T by tile parity (the other warpgroup's dQ product may still read the last
        # tile's), buffer 2 P^T (written again only after the next Q load, which waits for both
        # warpgroups' dV products)
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (tile_n, d, tile_m), self.dtype,
                                                   3 if cfg.split_head_dim else 2)
        # each warpgroup's block of the dQ tile, added by its own bulk reduce: (4 floats, thread,
        # chunk) per warpgroup, the fragments' order (dq_layout.py)
        chunks = (dq_m if cfg.dq_transposed else dq_n) // 8  # the MMA's N / 8
        sdQ_layout = cute.make_layout((4, _WG, chunks, 2), stride=(1, 4, 4 * _WG, dq_m * dq_n))
        # a tile's LSE and delta rows: TMA boxes start on 16-byte boundaries, so a packed sequence's
        # tile loads from the row below it that is a multiple of 4, four rows more than a tile
        sRow_layout = cute.make_layout((self.row_box, 2), stride=(1, -(-self.row_box // 32) * 32))  # 128-byte stages

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tile_q, tile_do = cute.select(sQ_layout, mode=[0, 1]), cute.select(sdO_layout, mode=[0, 1])
        tile_k, tile_v = cute.select(sK_layout, mode=[0, 1]), cute.select(sV_layout, mode=[0, 1])
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load_op, q, tile_q, (tile_m, d))
        tma_do, tma_tensor_do = cpasync.make_tiled_tma_atom(load_op, do, tile_do, (tile_m, d_v))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load_op, k, tile_k, (tile_n, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load_op, v, tile_v, (tile_n, d_v))
        row_box = cute.make_layout(self.row_box)
        tma_lse, tma_tensor_lse = cpasync.make_tiled_tma_atom(load_op, lse2, row_box, (self.row_box,))
        tma_delta, tma_tensor_delta = cpasync.make_tiled_tma_atom(load_op, delta, row_box, (self.row_box,))
        tma_dk = tma_tensor_dk = tma_dv = tma_tensor_dv = dk = dv = None
        if const_expr(cfg.dkv_store_tma):
            kv_wg_layout = wg_slice_layout(tile_k, tile_n, d)
            store_op = cpasync.CopyBulkTensorTileS2GOp()
            dk, dv = bshd_to_sdhb(mdK, varlen), bshd_to_sdhb(mdV, varlen)
            tma_dk, tma_tensor_dk = cpasync.make_tiled_tma_atom(store_op, dk, kv_wg_layout, (64, d))
            tma_dv, tma_tensor_dv = cpasync.make_tiled_tma_atom(store_op, dv, kv_wg_layout, (64, d))
        self.qdo_bytes = cute.size_in_bytes(self.dtype, tile_q) + cute.size_in_bytes(self.dtype, tile_do) + \
            2 * self.row_box * 4
        self.kv_bytes = cute.size_in_bytes(self.dtype, tile_k) + cute.size_in_bytes(self.dtype, tile_v)

        @cute.struct
        class SharedStorage:
            qdo_mbar: cute.struct.MemRange[cutlass.Int64, 2 * 2]
            kv_mbar: cute.struct.MemRange[cutlass.Int64, 2]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sRow_layout)], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        if const_expr(SharedStorage.size_in_bytes() > SMEM_LIMIT):
            raise ValueError(f"the backward's shared memory ({SharedStorage.size_in_bytes()} bytes at tile_m "
                             f"{tile_m}, head_dim {d}) exceeds the {SMEM_LIMIT} a Hopper CTA may use")
        self.shared_storage = SharedStorage
        seqlen_k = max_seqlen_k if const_expr(varlen) else k.shape[0]
        num_n_blocks = (seqlen_k + tile_n - 1) // tile_n
        num_batches = mCuSeqlensQ.shape[0] - 1 if const_expr(varlen) else k.shape[3]
        # listed: one grid dim (no 65535 limit), the K/V heads fastest, so the costliest tiles of
        # every head start first
        grid = [num_n_blocks, k.shape[2], num_batches]
        if const_expr(cfg.kv_tiles_costliest_first):
            grid = [k.shape[2], num_batches, num_n_blocks]
        if const_expr(cfg.tiles_listed):
            grid = [cfg.list_pieces * k.shape[2] * mTileTable.shape[0], 1, 1]
        if const_expr(varlen):
            self.describe_sequences(tma_q, tma_k, tma_v, tma_do, tma_dk, tma_dv, q, k, v, do, dk, dv, mCuSeqlensQ, mCuSeqlensK, mSeqDescriptors, mErrors, max_seqlen_q,
                                    max_seqlen_k).launch(
                grid=[num_batches, 1, 1], block=[32, 1, 1], stream=stream)
        if const_expr(cfg.tiles_listed_by_launch):
            self.list_work_tiles(mCuSeqlensQ, mCuSeqlensK, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                                 window_left, window_right, mTileTable, mTileCount).launch(
                grid=[1, 1, 1], block=[COST_BINS, 1, 1], smem=cost_bins_bytes(), stream=stream)
        self.kernel(mma_sdp, mma_dkv, mma_dv, mma_dq, tma_q, tma_tensor_q, tma_do, tma_tensor_do, tma_k, tma_tensor_k,
                    tma_v, tma_tensor_v, tma_lse, tma_tensor_lse, tma_delta, tma_tensor_delta, mdQacc,
                    mdK, mdV, tma_dk, tma_tensor_dk, tma_dv, tma_tensor_dv, mCuSeqlensQ, mCuSeqlensK,
                    mSeqDescriptors, mSemaphores, mTileTable, mTileCount, mModTensors, mBlockLists,
                    max_seqlen_q, max_seqlen_k, scale_log2, out_scale, score_scale, softcap_factor, window_left,
                    window_right, sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sdQ_layout,
                    sRow_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1],
            smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def describe_sequences(self, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
                           tma_do: cute.CopyAtom, tma_dk: Optional[cute.CopyAtom],
                           tma_dv: Optional[cute.CopyAtom], q: cute.Tensor, k: cute.Tensor,
                           v: cute.Tensor, do: cute.Tensor, dk: Optional[cute.Tensor],
                           dv: Optional[cute.Tensor], mCuSeqlensQ: cute.Tensor,
                           mCuSeqlensK: cute.Tensor, mSeqDescriptors: cute.Tensor, mErrors: cute.Tensor,
                           max_seqlen_q: Int32, max_seqlen_k: Int32):
        """One warp per sequence: the four (six) descriptors of its rows (all tensors (S, D, H, 1))."""
        batch = Int32(cute.arch.block_idx()[0])
        seq = SequenceInfo.create(batch, q.shape[0], k.shape[0], mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, max_seqlen_k)
        seq_desc.flag_bad_offsets(mCuSeqlensQ, mCuSeqlensK, batch, seq, q.shape[0], k.shape[0], mErrors)
        offset_q, len_q, offset_k, len_k = seq_desc.sequence_extents(seq)
        for atom, t, offset, length, which in ((tma_q, q, offset_q, len_q, seq_desc.Q),
                                               (tma_do, do, offset_q, len_q, seq_desc.DO),
                                               (tma_k, k, offset_k, len_k, seq_desc.K),
                                               (tma_v, v, offset_k, len_k, seq_desc.V)):
            seq_desc.write_sequence_descriptor(atom, seq_desc.sequence_rows(t, offset, length, 0), mSeqDescriptors,
                                               batch, which)
        if const_expr(self.cfg.dkv_store_tma):
            for atom, t, which in ((tma_dk, dk, seq_desc.DK), (tma_dv, dv, seq_desc.DV)):
                seq_desc.write_sequence_descriptor(atom, seq_desc.sequence_rows(t, offset_k, len_k, 0),
                                                   mSeqDescriptors, batch, which)
        cpasync.fence_tma_desc_release()

    @cute.kernel
    def kernel(self, mma_sdp: cute.TiledMma, mma_dkv: cute.TiledMma, mma_dv: cute.TiledMma, mma_dq: cute.TiledMma,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_do: cute.CopyAtom, mdO: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_v: cute.CopyAtom, mV: cute.Tensor,
               tma_lse: cute.CopyAtom, mLSE2: cute.Tensor, tma_delta: cute.CopyAtom, mDelta: cute.Tensor,
               mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               tma_dk: Optional[cute.CopyAtom], mdK_tma: Optional[cute.Tensor], tma_dv: Optional[cute.CopyAtom],
               mdV_tma: Optional[cute.Tensor], mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqDescriptors: Optional[cute.Tensor], mSemaphores: Optional[cute.Tensor],
               mTileTable: Optional[cute.Tensor], mTileCount: Optional[cute.Tensor],
               mModTensors: Optional[tuple], mBlockLists: Optional[tuple], max_seqlen_q: Int32,
               max_seqlen_k: Int32, scale_log2: Float32, out_scale: Float32, score_scale: Float32,
               softcap_factor: Optional[Float32], window_left: Optional[Int32], window_right: Optional[Int32],
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout, sdQ_layout, sRow_layout: cute.Layout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch, piece = self.work_tile(mTileTable, mTileCount, mK.shape[2])
        if warp_idx == 0:
            for atom in (tma_q, tma_do, tma_k, tma_v, tma_lse, tma_delta):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.cfg.dkv_store_tma):
                cpasync.prefetch_descriptor(tma_dk)
                cpasync.prefetch_descriptor(tma_dv)
        storage = SmemAllocator().allocate(self.shared_storage)
        one_thread = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, 8)
        qdo_producer, qdo_consumer = pipeline.PipelineTmaAsync.create(
            num_stages=self.cfg.q_stages, producer_group=one_thread, consumer_group=consumer_warps,
            tx_count=self.qdo_bytes,
            barrier_storage=storage.qdo_mbar.data_ptr(), defer_sync=True).make_participants()
        kv_producer, kv_consumer = pipeline.PipelineTmaAsync.create(
            num_stages=1, producer_group=one_thread, consumer_group=consumer_warps, tx_count=self.kv_bytes,
            barrier_storage=storage.kv_mbar.data_ptr(), defer_sync=True).make_participants()
        pipeline.pipeline_init_arrive()
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sLSE2 = storage.sLSE2.get_tensor(sRow_layout)
        sDelta = storage.sDelta.get_tensor(sRow_layout)
        pipeline.pipeline_init_wait()

        seq = SequenceInfo.create(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, max_seqlen_k)
        group = mQ.shape[2] // mK.shape[2]
        # varlen grids over the longest sequence have K/V tiles past a sequence's end; a listed
        # grid has entries past its list's count, and a selection list fewer shares than CTAs:
        # none of these has work
        has_work = n_block * self.tile_n < seq.seqlen_k
        selected = None
        if const_expr(self.cfg.select_block):
            selected = SelectedQueryVisits(mBlockLists, batch, n_block, mK.shape[2], piece)
            has_work = has_work & selected.has_work(head_kv)
        if has_work:
            if const_expr(self.cfg.select_block):
                visits = selected
            else:
                m_start, m_end = self.query_tiles(n_block, seq.seqlen_q, seq.seqlen_k, window_left, window_right)
                visits = QueryVisits(m_start, m_end, mBlockLists, batch, n_block, self.cfg.deterministic)
            if warp_idx < 4:
                # 24: what the consumers' 240 need of this CTA's registers (a larger count would
                # leave their increase waiting forever)
                cute.arch.setmaxregister_decrease(24)
                if warp_idx == 0:
                    self.producer(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_lse, mLSE2, tma_delta, mDelta,
                                  sQ, sdO, sK, sV, sLSE2, sDelta, qdo_producer, kv_producer, mSeqDescriptors, n_block,
                                  head_kv, batch, group, visits, seq)
                if warp_idx == 1:
                    self.dq_writer(mdQacc, sdQ, mSemaphores, window_left, window_right,
                                   n_block, head_kv, batch, group, visits, seq)
            else:
                cute.arch.setmaxregister_increase(240)
                self.consumer(mma_sdp, mma_dkv, mma_dv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE2, sDelta, qdo_consumer,
                              kv_consumer, mdK, mdV, tma_dk, mdK_tma, tma_dv, mdV_tma, mSeqDescriptors, scale_log2,
                              out_scale, score_scale, softcap_factor, window_left, window_right, n_block, head_kv,
                              batch, group, visits, seq, tidx - _WG, mModTensors)

    @cute.jit
    def work_tile(self, mTileTable: Optional[cute.Tensor], mTileCount: Optional[cute.Tensor], num_heads_kv):
        """(K/V tile, K/V head, sequence, share of its list) of this CTA: its block index (the tile
        slowest with ``kv_tiles_costliest_first``), or its entry of the tile list (an entry past
        the list's count gets a tile past every sequence's end), the shares of one tile's list
        (``cfg.list_pieces``) adjacent."""
        n_block, head_kv, batch = cute.arch.block_idx()
        piece = Int32(0)
        if const_expr(self.cfg.kv_tiles_costliest_first):
            head_kv, batch, n_block = cute.arch.block_idx()
        if const_expr(self.cfg.tiles_listed):
            if const_expr(self.cfg.list_pieces > 1):
                piece, n_block = n_block % self.cfg.list_pieces, n_block // self.cfg.list_pieces
            head_kv, entry = n_block % num_heads_kv, n_block // num_heads_kv
            count = mTileTable.shape[0]
            if const_expr(self.cfg.tiles_on_device):  # bad offsets (flagged) may count more than fits
                count = cutlass.min(mTileCount[0], count)
            at = cutlass.max(cutlass.min(entry, count - 1), 0)  # in the table (it has a row even when empty)
            listed = entry < count
            batch = Int32(cutlass.select_(listed, mTileTable[at, 0], Int32(0)))
            n_block = Int32(cutlass.select_(listed, mTileTable[at, 1], Int32(2**30 // self.tile_n)))
        return n_block, head_kv, batch, piece

    def listed_tiles(self, seq: SequenceInfo):
        """Varlen tile lists (``device_tile_list``): a sequence's K/V tiles with keys."""
        return (seq.seqlen_k + self.tile_n - 1) // self.tile_n

    def listed_tile_cost(self, n_block, seq: SequenceInfo, window_left, window_right):
        """A listed K/V tile's cost: the query tiles it visits, plus one (it writes dK and dV even
        when it visits none). Selection: the query tiles from its first key's position on (a
        position keeps only keys up to itself)."""
        if const_expr(self.cfg.select_block):
            m_tiles = (seq.seqlen_q + self.tile_m - 1) // self.tile_m
            return m_tiles - n_block * self.tile_n * self.cfg.rows_per_query // self.tile_m + 1
        m_start, m_end = self.query_tiles(n_block, seq.seqlen_q, seq.seqlen_k, window_left, window_right)
        return m_end - m_start + 1

    def query_tiles(self, n_block, seqlen_q, seqlen_k, window_left, window_right):
        """[m_start, m_end): the query tiles some row of which keeps a key of K/V tile ``n_block``
        (the K/V walk's transpose, ``common/kv_walk.py``)."""
        cfg = self.cfg
        walk = query_walk(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, cfg.mask_kind, window_left,
                          window_right, cfg.bottom_right, imin=cutlass.min, imax=cutlass.max,
                          compression=cfg.compression, select=cutlass.select_)
        return walk.start, walk.end

    @cute.jit
    def producer(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, tma_lse, mLSE2, tma_delta, mDelta,
                 sQ, sdO, sK, sV, sLSE2, sDelta, qdo_producer: pipeline.PipelineProducer,
                 kv_producer: pipeline.PipelineProducer, mSeqDescriptors: Optional[cute.Tensor], n_block, head_kv,
                 batch, group, visits, seq: SequenceInfo):
        """Warp 0: K and V once, then per query tile its Q, dO, LSE and delta into the ring
        (``cfg.q_stages``)."""
        d, dv, tile_m = self.cfg.head_dim, self.cfg.head_dim_v, self.tile_m
        desc_q = desc_do = desc_k = desc_v = None  # None: the descriptor built into the TMA atom
        row_batch = batch
        if const_expr(self.cfg.varlen):
            # the sequence's own descriptors: coordinates relative to its first row
            desc_q, desc_do, desc_k, desc_v = (seq_desc.acquire_descriptor(mSeqDescriptors, batch, which)
                                               for which in (seq_desc.Q, seq_desc.DO, seq_desc.K, seq_desc.V))
            row_batch = Int32(0)  # varlen tensors have one batch row, the packed tokens
        gK = cute.local_tile(mK[None, None, head_kv, row_batch], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, row_batch], (self.tile_n, dv), (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        handle = kv_producer.acquire_and_advance()
        cute.copy(tma_k, tKgK, tKsK[None, 0], tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_k)
        cute.copy(tma_v, tVgV, tVsV[None, 0], tma_bar_ptr=handle.barrier, tma_desc_ptr=desc_v)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gQ = cute.local_tile(mQ[None, None, head, row_batch], (tile_m, d), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, row_batch], (tile_m, dv), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tiles(tma_do, sdO, gdO)
            m_start, m_end = visits.range(head)
            for i in cutlass.range(m_start, m_end, unroll=1):
                m_block = visits.tile_at(i, head)
                handle = qdo_producer.acquire_and_advance()
                cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, handle.index], tma_bar_ptr=handle.barrier,
                          tma_desc_ptr=desc_q)
                cute.copy(tma_do, tdOgdO[None, m_block], tdOsdO[None, handle.index], tma_bar_ptr=handle.barrier,
                          tma_desc_ptr=desc_do)
                # the row statistics through the whole tensor's descriptor, from the multiple of 4
                # at or below the tile's first row (the consumers skip the rows before it)
                first = (seq.offset_q + m_block * tile_m) // ROW_ALIGN * ROW_ALIGN
                for atom, rows, smem in ((tma_lse, mLSE2, sLSE2), (tma_delta, mDelta, sDelta)):
                    box = cute.local_tile(cute.domain_offset((first,), rows[None, head, row_batch]), (self.row_box,),
                                          (None,))
                    tRs, tRg = tma_tiles(atom, smem, box, tile_rank=1)
                    cute.copy(atom, tRg[None, 0], tRs[None, handle.index], tma_bar_ptr=handle.barrier)

    @cute.jit
    def dq_writer(self, mdQacc, sdQ, mSemaphores: Optional[cute.Tensor], window_left, window_right, n_block,
                  head_kv, batch, group, visits, seq: SequenceInfo):
        """Warp 1: adds each query tile's dQ into the fp32 accumulator, one bulk reduce-add per
        consumer warpgroup's block, as soon as that block is staged; frees each block once its add
        has read it. ``deterministic``: each tile's adds wait for their turn (``wait_for_turn``)."""
        cfg = self.cfg
        first_tile = Int32(0)  # the sequence's first tile of the accumulator
        if const_expr(cfg.varlen):
            first_tile = dq_layout.first_tile(seq.offset_q, batch, self.tile_m)
        block = cfg.dq_rows_per_warpgroup * cfg.dq_cols_per_warpgroup
        # deterministic: the query tiles that K/V tile n_block - 1 adds into (none for tile 0)
        prev_start, prev_end = Int32(0), Int32(0)
        if const_expr(cfg.deterministic and not cfg.select_block):
            if n_block > 0:
                prev_start, prev_end = self.query_tiles(n_block - 1, seq.seqlen_q, seq.seqlen_k, window_left,
                                                        window_right)
        last = visits.total(head_kv, group) - 1
        if last >= 0:  # the first tile's blocks are free (no arrival that nobody waits for)
            for wg in cutlass.range_constexpr(2):
                cute.arch.barrier_arrive(barrier_id=NamedBarrierBwd.DQ_EMPTY + wg, number_of_threads=_WG + 32)
        t = Int32(0)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            m_start, m_end = visits.range(head)
            for i in cutlass.range(m_start, m_end, unroll=1):
                m_block = visits.tile_at(i, head)
                sem = next_turn = None
                if const_expr(cfg.deterministic):
                    if const_expr(cfg.select_block):  # the tile's adds in K/V tile order (its list's turns)
                        sem = mSemaphores.iterator + cute.crd2idx((0, head, first_tile + m_block), mSemaphores.layout)
                        turn = visits.turn(i)
                        next_turn = turn + 1
                    else:  # tile n_block - 1 is the predecessor where it adds into this query tile
                        sem = mSemaphores.iterator + cute.crd2idx((batch, head, m_block), mSemaphores.layout)
                        has_predecessor = prev_start <= m_block and m_block < prev_end
                        turn = Int32(cutlass.select_(has_predecessor, n_block, Int32(0)))
                        next_turn = n_block + 1
                    self.wait_for_turn(sem, turn)
                for wg in cutlass.range_constexpr(2):
                    cute.arch.barrier(barrier_id=NamedBarrierBwd.DQ_FULL + wg, number_of_threads=_WG + 32)
                    if const_expr(cfg.varlen):
                        tile = mdQacc[head, first_tile + m_block, None]
                    else:
                        tile = mdQacc[batch, head, m_block, None]
                    with cute.arch.elect_one():
                        bulk_reduce_add_f32(tile.iterator + wg * block, sdQ[None, None, None, wg].iterator, block * 4)
                    cute.arch.cp_async_bulk_commit_group()
                if const_expr(cfg.deterministic):
                    self.pass_turn(sem, next_turn)
                for wg in cutlass.range_constexpr(2):
                    cute.arch.cp_async_bulk_wait_group(1 - wg, read=True)
                    if t < last:
                        cute.arch.barrier_arrive(barrier_id=NamedBarrierBwd.DQ_EMPTY + wg,
                                                 number_of_threads=_WG + 32)
                t += 1

    @cute.jit
    def wait_for_turn(self, sem, turn):
        """The dQ warp: spin until the query tile's semaphore ``sem`` reads ``turn`` (the K/V
        tiles before this one have completed their adds)."""
        while cute.arch.load(sem, Int32, sem="acquire", scope="gpu") != turn:
            pass
        # the reduce-add about to be issued (async proxy) comes after what the acquire saw
        cute.arch.fence_proxy("async.global")

    @cute.jit
    def pass_turn(self, sem, next_turn):
        """The dQ warp, after issuing its add: wait until the add has completed (not just read
        shared memory), then hand the query tile to the next K/V tile."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)  # on the lane that issued it
        cute.arch.sync_warp()
        cute.arch.fence_proxy("async.global")
        with cute.arch.elect_one():
            cute.arch.store(sem, next_turn, sem="release", scope="gpu")
