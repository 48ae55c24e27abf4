"""The Hopper forward kernel in its decode configurations (``config.decode_config``): the host side
of ``attention_with_kvcache`` calls (dense query batches over a dense or paged cache, GQA packing,
split-KV and the combine pass, appends), of mixed batches (packed query rows over a cache), and of
dense ``fmha.attention`` calls with few query rows."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from fmha import device_errors
from fmha.jit import disk_cache
from fmha.jit.launch import answered_without_launch, fill_empty_lse, sinks_fp32, sm_count
from fmha.masking import MaskKind, MaskSpec
from fmha.problem import AttentionProblem, KernelOptions

from .forward_runner import ForwardArgs, compile_forward
from .config import HopperForwardConfig, decode_config, decode_tile, why_unsupported_decode
from .decode_passes import append_to_cache, compile_split_combine


class DecodePlan(NamedTuple):
    """How one ``attention_with_kvcache`` call runs (``HopperDecodeRunner.plan``)."""

    cfg: HopperForwardConfig
    packed: bool  # a GQA group's query heads share a query tile
    rows: int  # query rows per (batch entry, head) as the kernel sees them
    heads: int  # query heads as the kernel sees them
    splits: int
    mask: MaskSpec


class HopperDecodeRunner:
    """The forward kernel in its decode configurations (``config.decode_config``) for one kind of
    ``attention_with_kvcache`` call: packs a GQA group's query heads into one query tile where the
    tile would otherwise be mostly empty, splits the keys over CTAs where the tiles cannot fill
    the GPU, and merges the splits (``fmha.split_kv``)."""

    def __init__(self, problem):
        self._compiled = {}
        self._last_plan = (None, None)
        self._plans = {}  # a decode loop repeats its problem: plan it once

    def plan(self, problem, num_sms: int) -> DecodePlan:
        from fmha import split_kv

        group = problem.heads_q // problem.heads_k
        tile_m, tile_n = decode_tile(problem.dtype, problem.head_dim, problem.head_dim_v, problem.kv_dtype)
        # else the query tiles are full without packing; a mixed batch's decodes need it
        packed = group > 1 and (problem.seqlen_q < tile_m or problem.packed_q)
        rows, heads = (problem.seqlen_q * group, problem.heads_k) if packed else (problem.seqlen_q, problem.heads_q)
        tiles = problem.batch * heads * -(-rows // tile_m)
        m = problem.mask
        span = problem.capacity  # the most keys a query tile visits: the cache, or what the mask leaves of it
        if m.window_left is not None:
            span = min(span, m.window_left + problem.seqlen_q + (m.window_right or 0))
        elif m.kind == MaskKind.WINDOW and not m.bottom_right:
            span = min(span, problem.seqlen_q + m.window_right)
        span = max(span, 1)  # negative window sides can leave nothing
        splits = problem.num_splits or split_kv.choose_num_splits(tiles, num_sms, -(-span // tile_n))
        if problem.packed_q:
            splits = 1  # packed queries list their tiles on the GPU, with no split dimension yet
        if (problem.seqlen_q == 1 and m.kind == MaskKind.WINDOW and m.bottom_right and m.window_left is None
                and m.window_right >= 0):
            m = MaskSpec(MaskKind.NONE)  # one bottom-right row sees every key up to the last
        cfg = decode_config(problem.dtype, problem.out_dtype, problem.head_dim, m.kind, m.window_left is not None,
                            m.window_right is not None, m.bottom_right, problem.return_lse, group if packed else 1,
                            splits > 1, problem.page_size, problem.capacity, problem.softcap > 0, problem.has_sinks,
                            problem.head_dim_v, packed_q=problem.packed_q, kv_dtype=problem.kv_dtype,
                            kv_scale_tensors=problem.kv_scale_tensors)
        return DecodePlan(cfg, packed, rows, heads, splits, m)

    def __call__(self, problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks=None, cu_seqlens_q=None,
                 cache_scales=None):
        """``cache_scales``: an fp8 cache's (scale_k, scale_v) as (B, H_k) fp32 tensors, or None."""
        from fmha import split_kv

        if problem.packed_q:
            return self.run_packed(problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks, cu_seqlens_q,
                                   cache_scales)
        b, s_q, h_q, _ = q.shape
        d = v_cache.shape[-1]  # O's head dim
        if b == 0 or s_q == 0 or h_q == 0 or problem.capacity == 0 or problem.num_pages == 0:
            self.answer_empty(problem, q, lengths, out, lse, sinks)
            return
        plan = self.plan_of(problem, q.device)
        q_in = split_kv.pack_gqa(q, problem.heads_k) if plan.packed else q
        rows, heads, splits = plan.rows, plan.heads, plan.splits
        unpack = False  # packed rows written apart, then copied into out/lse
        if splits > 1:
            o_k = torch.empty((splits * b, rows, heads, d), dtype=torch.float32, device=q.device)
            lse_k = torch.empty((splits * b, heads, rows), dtype=torch.float32, device=q.device)
        elif plan.packed:
            # one query row (decode): the packed rows are a view of out and lse, written in place
            views = split_kv.packed_views(out, lse, problem.heads_k, s_q)
            unpack = views is None
            if unpack:
                o_k = torch.empty((b, rows, heads, d), dtype=out.dtype, device=q.device)
                lse_k = torch.empty((b, heads, rows), dtype=torch.float32, device=q.device) if lse is not None \
                    else None
            else:
                o_k, lse_k = views
        else:
            o_k, lse_k = out, lse
        self.launch(plan, problem, q_in, k_cache, v_cache, o_k, lse_k, lengths, block_table, sinks,
                    num_splits=splits if plan.cfg.split_kv else None, mCacheScales=cache_scales)
        if splits > 1:  # merged, and unpacked on the way
            from ..common.split_combine import SplitCombineConfig

            combine = self.load(SplitCombineConfig(out.dtype, d, lse is not None), compile_split_combine)
            combine(o_k, lse_k, out, lse, splits, h_q // heads)
        elif unpack:
            split_kv.unpack_gqa(o_k, lse_k, s_q, out, lse)

    def run_packed(self, problem, q, k_cache, v_cache, lengths, block_table, out, lse, sinks, cu_seqlens_q,
                   cache_scales=None):
        """A mixed batch: packed query rows (T_q, H_q, D) at ``cu_seqlens_q`` over the cache. A GQA
        group's heads are packed into rows (row t * g + j: token t, head h * g + j), the offsets
        scaled to match on the GPU, and the tiles listed there (nothing is read back)."""
        from fmha import split_kv

        t_q, h_q, _ = q.shape
        if t_q == 0 or h_q == 0 or problem.batch == 0 or problem.capacity == 0 or problem.num_pages == 0:
            self.answer_empty(problem, q, lengths, out, lse, sinks)
            return
        plan = self.plan_of(problem, q.device)
        g = h_q // plan.heads
        q_in, cu_in, o_k, lse_k = q, cu_seqlens_q, out, lse
        if g > 1:
            q_in = split_kv.pack_gqa(q[None], plan.heads)[0]
            # clamped first, so that no bad offset wraps around int32 into a valid one: the
            # kernel still flags every clamped value (-1 and T_q + 1 are never valid)
            cu_in = cu_seqlens_q.clamp(-1, t_q + 1) * g
            o_k = torch.empty((t_q * g, plan.heads, out.shape[-1]), dtype=out.dtype, device=q.device)
            lse_k = torch.empty((plan.heads, t_q * g), dtype=torch.float32, device=q.device) if lse is not None else None
        rows = plan.rows  # the longest sequence's rows, as the kernel counts them
        # room for every query tile the offsets can give (clamped to ``rows`` each)
        capacity = max(1, min(problem.batch * -(-rows // plan.cfg.tile_m), -(-t_q * g // plan.cfg.tile_m) + problem.batch))
        tiles = torch.empty((capacity, 2), dtype=torch.int32, device=q.device)
        count = torch.empty(1, dtype=torch.int32, device=q.device)
        descriptors = torch.empty((problem.batch, plan.cfg.sequence_descriptors, 16), dtype=torch.int64,
                                  device=q.device)
        self.launch(plan, problem, q_in, k_cache, v_cache, o_k, lse_k, lengths, block_table, sinks,
                    mCuSeqlensQ=cu_in, mTileTable=tiles, mTileCount=count, mSeqDescriptors=descriptors,
                    mCacheScales=cache_scales)
        if g > 1:
            split_kv.unpack_gqa(o_k[None], None if lse is None else lse_k[None], t_q, out[None],
                                None if lse is None else lse[None])

    def launch(self, plan: DecodePlan, problem, q, k_cache, v_cache, o, lse, lengths, block_table, sinks,
               **arguments) -> None:
        """The forward kernel of ``plan`` on the call's tensors as the kernel sees them (q and O
        packed where GQA rows are); ``arguments``: the launch's other ``ForwardArgs`` (split
        count, packed queries' offsets and tile list)."""
        cfg, m = plan.cfg, plan.mask
        if problem.page_size:  # the kernel reads the pages as one run of rows
            k_cache = k_cache.flatten(0, 1).unsqueeze(0)
            v_cache = v_cache.flatten(0, 1).unsqueeze(0)
        self.load(cfg, compile_forward)(*ForwardArgs(
            mQ=q, mK=k_cache, mV=v_cache, mO=o, mLSE=lse if cfg.has_lse else None,
            mErrors=device_errors.flag(q.device), mCacheSeqlens=lengths, mBlockTable=block_table,
            mSinks=sinks_fp32(sinks) if cfg.has_sinks else None, max_seqlen_q=plan.rows,
            scale_log2=problem.softmax_scale_log2, output_scale=problem.output_scale,
            softcap_factor=problem.softcap_factor if cfg.softcap else None, window_left=m.window_left,
            window_right=m.window_right, num_ctas=sm_count(q.device),
            page_size=problem.page_size if cfg.page_run else None, **arguments))

    def plan_of(self, problem, device) -> DecodePlan:
        if problem is self._last_plan[0]:  # a decode loop's memo hands back the same problem
            return self._last_plan[1]
        plan = self._plans.get(problem)
        if plan is None:
            if len(self._plans) > 1024:
                self._plans.clear()
            plan = self._plans[problem] = self.plan(problem, sm_count(device))
        self._last_plan = (problem, plan)
        return plan

    @staticmethod
    def answer_empty(problem, q, lengths, out, lse, sinks) -> None:
        """No query rows, or a cache that holds no key: O = 0, LSE = -inf (or the sink); a
        cache of no positions flags every length above 0."""
        out.zero_()
        if lse is not None:
            fill_empty_lse(lse, sinks)
        if problem.batch and (problem.capacity == 0 or problem.num_pages == 0):  # any length > 0 cannot be held
            from fmha.kernels.common.error_bits import BAD_CACHE_LENGTH

            device_errors.flag(q.device).bitwise_or_((lengths > 0).any().int() * BAD_CACHE_LENGTH)

    def append(self, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity: int) -> None:
        """The call's new keys and values into the cache, before ``__call__`` reads it."""
        append_to_cache(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, capacity)

    def load(self, cfg, compile_fn) -> Callable:
        kernel = self._compiled.get(cfg)
        if kernel is None:
            kernel = self._compiled[cfg] = disk_cache.load_or_compile(cfg, compile_fn)
        return kernel


def served_as_decode(problem: AttentionProblem, options: KernelOptions) -> bool:
    """Whether a dense forward goes through the decode configuration: few query rows per head
    (the query tiles would be mostly empty) and either query heads to pack (GQA) or too few tiles
    to fill the GPU without splitting the keys. Pinned kernel options keep the prefill one."""
    if (problem.device.type != "cuda" or problem.varlen or problem.dtype not in (torch.float16, torch.bfloat16)
            or problem.mods is not None
            or options.tile_m or options.tile_n
            or options.persistent is not None or options.claim_tiles is not None
            or problem.mask.kind not in (MaskKind.NONE, MaskKind.WINDOW) or problem.seqlen_k == 0):
        return False
    if why_unsupported_decode(dense_decode_problem(problem, problem.return_lse)) \
            or problem.seqlen_q >= decode_tile(problem.dtype, problem.head_dim, problem.head_dim_v)[0]:
        return False
    group = problem.num_heads_q // problem.num_heads_k
    tiles = problem.batch * (problem.num_heads_k if group > 1 else problem.num_heads_q)
    return group > 1 or tiles < 0.8 * sm_count(problem.device)


def dense_decode_problem(problem: AttentionProblem, return_lse: bool):
    """A dense forward as decode over a full cache: every sequence holds all S_k keys."""
    from fmha.kvcache import DecodeProblem

    return DecodeProblem(
        batch=problem.batch, seqlen_q=problem.seqlen_q, heads_q=problem.num_heads_q, heads_k=problem.num_heads_k,
        head_dim=problem.head_dim, head_dim_v=problem.head_dim_v, dtype=problem.dtype, out_dtype=problem.out_dtype,
        mask=problem.mask, page_size=0, capacity=problem.seqlen_k, num_pages=problem.batch, seqlen_new=0,
        score_scale=problem.score_scale, output_scale=problem.output_scale, return_lse=return_lse,
        softcap=problem.softcap, has_sinks=problem.has_sinks, device=problem.device)


class HopperDenseDecodeRunner:
    """A dense ``fmha.attention`` call with few query rows, run as decode over a full cache."""

    def __init__(self, problem: AttentionProblem):
        self.decode = HopperDecodeRunner(problem)
        self._lengths = {}

    def lengths(self, batch: int, seqlen_k: int, device) -> torch.Tensor:
        key = (batch, seqlen_k, device)
        lengths = self._lengths.get(key)
        if lengths is None:
            lengths = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
            if not torch.cuda.is_current_stream_capturing():  # filled by the graph's replay only
                if len(self._lengths) >= 64:  # a decode loop's length grows every step
                    self._lengths.clear()
                self._lengths[key] = lengths
        return lengths

    def __call__(self, problem: AttentionProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
                 sinks=None):
        if answered_without_launch(problem, out, lse, sinks):
            return
        decode = dense_decode_problem(problem, lse is not None)
        self.decode(decode, q, k, v, self.lengths(problem.batch, problem.seqlen_k, q.device), None, out, lse,
                    sinks)
