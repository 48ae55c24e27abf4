"""Exact attention in plain PyTorch (docs/semantics.md), on any device: the oracle for kernels and the
fallback when no kernel applies.

Scores are computed a bounded chunk at a time (a block of query rows times a block of heads,
restricted to the union of the rows' kept key bands), so long sequences fit in memory: the
largest temporary is about ``chunk_bytes``, never S_q x S_k for all heads.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .masking import MaskSpec, row_key_bounds
from .mods import CallMods, Dual, call_mask_mod, call_score_mod

__all__ = ["attention_reference", "attention_backward_reference", "cast_output", "DEFAULT_CHUNK_BYTES", "FP8_MAX"]

#: budget for one block of scores (the dominant temporary); 256 MiB
DEFAULT_CHUNK_BYTES = 256 << 20
#: largest finite float8_e4m3fn
FP8_MAX = 448.0


def _torch_min(a, b):
    return torch.clamp(a, max=b) if torch.is_tensor(a) else min(a, b)


def _torch_max(a, b):
    return torch.clamp(a, min=b) if torch.is_tensor(a) else max(a, b)


def _row_bounds(rows: torch.Tensor, sq: int, sk: int, mask: MaskSpec):
    lo, hi = row_key_bounds(
        rows, sq, sk, mask.kind, mask.window_left, mask.window_right, mask.bottom_right,
        imin=_torch_min, imax=_torch_max, compression=mask.compression,
    )
    return lo, hi


def cast_output(o: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to the output dtype. fp8 saturates to +-448, as the hardware's cvt .satfinite does;
    clamping first makes that independent of how a torch build converts out-of-range values."""
    if dtype == torch.float8_e4m3fn:
        o = o.clamp(-FP8_MAX, FP8_MAX)
    return o.to(dtype)


def _sequences(batch: int, cu_seqlens_q: Optional[torch.Tensor], cu_seqlens_k: Optional[torch.Tensor]):
    """(query index, key index, LSE index) of every sequence: a batch entry ``b`` of dense
    tensors, or the rows ``cu[b]:cu[b + 1]`` of packed ones (the LSE's token dim is its last)."""
    if cu_seqlens_q is None:
        return [(b, b, b) for b in range(batch)]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1]), (slice(None), slice(cq[b], cq[b + 1])))
            for b in range(len(cq) - 1)]


def _scales(head_dim: int, softmax_scale, scale_q, scale_k, scale_v, inv_scale_o):
    """(score scale, output scale) of the semantics."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    return softmax_scale * scale_q * scale_k, scale_v * inv_scale_o


def _chunk_sizes(sq: int, sk: int, heads: int, elem: int, budget: int):
    """(rows, heads) per block so that rows * heads * sk * elem <= budget (at least 1 x 1)."""
    per_row_head = max(sk, 1) * elem
    if sq * heads * per_row_head <= budget:
        return max(sq, 1), heads
    if sq * per_row_head <= budget:
        return max(sq, 1), max(1, budget // (sq * per_row_head))
    return max(1, budget // per_row_head), 1


def _scores(qc, kc, score_scale, softcap):
    """(scaled scores (heads, rows, keys) of a block, softcapped when ``softcap`` > 0; the tanh
    of the softcap, whose derivative the backward needs, or None)."""
    s = torch.einsum("rhd,khd->hrk", qc, kc) * score_scale
    if not softcap:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


def _apply_mods(mods: Optional[CallMods], s, keep, b: int, heads, rows, cols, slope: bool = False):
    """``score_mod`` on the scaled scores ``s`` (heads, rows, keys) and ``mask_mod`` / the block
    mask on ``keep`` (rows, keys), at sequence ``b``'s positions; returns (s, keep (heads, rows,
    keys), the score_mod's derivative where ``slope``, else None)."""
    if mods is None:
        return s, keep, None
    bi, h, q, kv = _mod_positions(b, heads, rows, cols)
    derivative = None
    if mods.score_mod is not None:
        if slope:
            # forward-mode through the mod (``fmha.mods.Dual``; the custom op's backward runs below
            # autograd, where torch.autograd.grad cannot)
            y = call_score_mod(mods.score_mod, mods.score_mod.fn, Dual(s, 1.0), bi, h, q, kv, mods.aux)
            y = Dual.of(y)
            derivative = torch.as_tensor(y.grad, dtype=s.dtype, device=s.device).expand(s.shape)
            s = torch.as_tensor(y.value, dtype=s.dtype).expand(s.shape).clone()
        else:
            s = torch.as_tensor(call_score_mod(mods.score_mod, mods.score_mod.fn, s, bi, h, q, kv, mods.aux),
                                dtype=s.dtype).expand(s.shape).clone()
    keep = keep.expand(s.shape)
    modded = None
    if mods.mask_mod is not None:
        modded = torch.as_tensor(call_mask_mod(mods.mask_mod, mods.mask_mod.fn, bi, h, q, kv, mods.aux),
                                 device=s.device).to(torch.bool).expand(s.shape)
    if mods.block_mask is not None:
        from .block_mask import FULL, PARTIAL

        state = mods.block_mask.element_keep(rows, cols, b, heads)
        partial_keep = (state == PARTIAL) if modded is None else (state == PARTIAL) & modded
        keep = keep & ((state == FULL) | partial_keep)
    elif modded is not None:
        keep = keep & modded
    return s, keep, derivative


def _mod_positions(b: int, heads, rows, cols):
    """(b, h, q_idx, kv_idx) as a mod sees them in the reference: broadcast index tensors over
    (heads, rows, keys)."""
    return torch.tensor(b, device=rows.device), heads.view(-1, 1, 1), rows.view(1, -1, 1), cols.view(1, 1, -1)


def kept_triples_with_mods(mods: CallMods, mask, seqlens_q, seqlens_k, num_heads: int, device) -> int:
    """The (head, row, key) triples a call keeps: its built-in mask's band, ``mask_mod`` and
    block mask, evaluated as the reference evaluates them (for FLOP counts)."""
    from dataclasses import replace

    mods = replace(mods, score_mod=None)
    heads = torch.arange(num_heads, device=device)
    total = 0
    for b, (sq, sk) in enumerate(zip(seqlens_q, seqlens_k)):
        step = max(1, (1 << 24) // max(1, sk * num_heads))
        for r0 in range(0, sq, step):
            rows = torch.arange(r0, min(r0 + step, sq), device=device)
            lo, hi = _row_bounds(rows, sq, sk, mask)
            cols = torch.arange(sk, device=device)
            keep = (cols >= lo[:, None]) & (cols < hi[:, None])
            scores = torch.zeros((), device=device).expand(num_heads, rows.numel(), sk)  # for the shape
            _, keep, _ = _apply_mods(mods, scores, keep, b, heads, rows, cols)
            total += int(keep.sum())
    return total


def _attend_sequence(q, k, v, o, lse, mask, score_scale, out_scale, fp8_p, cdt, budget, softcap=0.0, sinks=None,
                     mods=None, b=0):
    """One sequence: q (S_q, H_q, D), k (S_k, H_k, D), v (S_k, H_k, D_v) in any dtype and strides;
    writes o (S_q, H_q, D_v) and lse (H_q, S_q) of dtype ``cdt``. ``sinks``: (H_q,) logits in
    ``cdt``, or None. ``mods``: the call's score/mask mods, at batch index ``b``."""
    sq, hq = q.shape[0], q.shape[1]
    sk, hk = k.shape[0], k.shape[1]
    if sq == 0:
        return
    group = hq // hk
    rows_per, heads_per = _chunk_sizes(sq, sk, hq, torch.finfo(cdt).bits // 8, budget)
    for h0 in range(0, hq, heads_per):
        h1 = min(h0 + heads_per, hq)
        kv_heads = torch.arange(h0, h1, device=k.device) // group
        # Converting K/V once per head block, not per row block: they are re-read by every row.
        kc = k[:, kv_heads].to(cdt)
        vc = v[:, kv_heads].to(cdt)
        for r0 in range(0, sq, rows_per):
            r1 = min(r0 + rows_per, sq)
            rows = torch.arange(r0, r1, device=q.device)
            lo, hi = _row_bounds(rows, sq, sk, mask)
            # Bands are monotone in the row, so the block needs keys [lo(r0), hi(r1-1)) only.
            k0 = int(lo[0])
            k1 = max(int(hi[-1]), k0)
            cols = torch.arange(k0, k1, device=q.device)
            keep = (cols >= lo[:, None]) & (cols < hi[:, None])  # (rows, keys)

            qc = q[r0:r1, h0:h1].to(cdt)
            s, _ = _scores(qc, kc[k0:k1], score_scale, softcap)
            s, keep, _ = _apply_mods(mods, s, keep, b, torch.arange(h0, h1, device=q.device), rows, cols)
            s.masked_fill_(~keep, -math.inf)
            m = s.amax(dim=-1, keepdim=True) if k1 > k0 else s.new_full(s.shape[:2] + (1,), -math.inf)
            if sinks is not None:
                sink = sinks[h0:h1, None, None].expand(m.shape)
                m = torch.maximum(m, sink)
            # A row with nothing kept (and no sink) has max -inf; subtracting 0 keeps exp() at 0
            # instead of NaN.
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
            p = s.sub_(m).exp_()
            row_sum = p.sum(dim=-1, keepdim=True)
            if sinks is not None:
                row_sum = row_sum + (sink - m).exp()
            if fp8_p:
                # The kernel feeds P to the tensor cores in the input dtype; the sum stays fp32.
                p = p.to(torch.float8_e4m3fn).to(cdt)
            pv = torch.einsum("hrk,khd->rhd", p, vc[k0:k1])
            denom = torch.where(row_sum > 0, row_sum, torch.ones_like(row_sum))
            o[r0:r1, h0:h1] = pv / denom.squeeze(-1).transpose(0, 1)[..., None] * out_scale
            lse[h0:h1, r0:r1] = (m + torch.log(row_sum)).squeeze(-1)


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    *,
    mask: MaskSpec = MaskSpec(),
    softmax_scale: Optional[float] = None,
    scale_q: float = 1.0,
    scale_k: float = 1.0,
    scale_v: float = 1.0,
    inv_scale_o: float = 1.0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mods: Optional[CallMods] = None,
):
    """Attention forward as docs/semantics.md defines it. Dense: q (B, S_q, H_q, D), k/v (B, S_k, H_k, D[_v]); varlen
    (cu_seqlens given): q (T_q, H_q, D), k/v (T_k, H_k, D[_v]). Any strides.

    Returns ``(O, LSE)`` in ``compute_dtype``: O shaped like q with the last dim D_v, LSE
    (B, H_q, S_q) dense or (H_q, T_q) varlen (natural log; -inf for rows that keep no key, whose O
    is 0). fp8 inputs round the unnormalized P = exp(S - rowmax) to float8_e4m3fn before P.V.
    ``softcap`` > 0 caps the scaled scores at ``softcap * tanh(s / softcap)``; ``sinks`` (H_q,)
    adds ``exp(sinks[h])`` to every row's denominator of head h (and to its LSE). ``mods``
    (``fmha.mods.CallMods``): ``score_mod`` on the scaled (and capped) scores, ``mask_mod`` and the
    block mask on top of ``mask``.

    Inputs are assumed valid (see fmha.validation); varlen reads cu_seqlens on the host.
    """
    score_scale, out_scale = _scales(q.shape[-1], softmax_scale, scale_q, scale_k, scale_v, inv_scale_o)
    fp8_p = q.dtype == torch.float8_e4m3fn
    o = torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=compute_dtype, device=q.device)
    if cu_seqlens_q is not None:
        lse_shape = (q.shape[1], q.shape[0])
    else:
        lse_shape = (q.shape[0], q.shape[2], q.shape[1])
    lse = torch.full(lse_shape, -math.inf, dtype=compute_dtype, device=q.device)
    sinks_c = None if sinks is None else sinks.to(compute_dtype)
    for b, (iq, ik, il) in enumerate(_sequences(q.shape[0], cu_seqlens_q, cu_seqlens_k)):
        _attend_sequence(q[iq], k[ik], v[ik], o[iq], lse[il], mask, score_scale, out_scale, fp8_p,
                         compute_dtype, chunk_bytes, softcap, sinks_c, mods, b)
    return o, lse


def _grad_sequence(do, q, k, v, o, lse, dlse, dq, dk, dv, mask, score_scale, out_scale, cdt, budget, softcap=0.0,
                   sinks=None, dsinks=None, mods=None, b=0, daux=None):
    """One sequence's gradients (docs/semantics.md, "Backward"): do/o (S_q, H_q, D_v), q (S_q,
    H_q, D), k/v (S_k, H_k, D), lse/dlse (H_q, S_q); accumulates into dq, dk, dv of dtype ``cdt``
    (None: not computed). P is recomputed from the saved LSE; dS = P * (dP - delta) with delta =
    rowsum(dO * O) - dlse; with softcap, dS times the tanh's derivative; with sinks, ``dsinks``
    (H_q,) gains -sum_i P_sink[i] * delta_i. ``daux``: per aux tensor of ``mods`` an accumulator
    or None; each gains sum dS * d score_mod / d aux, by autograd through the mod."""
    sq, hq = q.shape[0], q.shape[1]
    sk, hk = k.shape[0], k.shape[1]
    if sq == 0:
        return
    # rows that keep no key (LSE -inf) have P = 0: take their LSE as 0 so exp(-inf - 0) = 0
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(cdt)
    delta = (do.to(cdt) * o.to(cdt)).sum(-1).transpose(0, 1)  # (H_q, S_q)
    if dlse is not None:
        delta = delta - dlse.to(cdt)
    if sinks is not None and dsinks is not None:
        dsinks += sink_gradient(sinks, lse, delta)
    if sk == 0:
        return
    group = hq // hk
    rows_per, heads_per = _chunk_sizes(sq, sk, hq, torch.finfo(cdt).bits // 8, budget)
    for h0 in range(0, hq, heads_per):
        h1 = min(h0 + heads_per, hq)
        kv_heads = torch.arange(h0, h1, device=k.device) // group
        kc = k[:, kv_heads].to(cdt)
        vc = v[:, kv_heads].to(cdt)
        dkc = torch.zeros_like(kc) if dq is not None else None
        dvc = torch.zeros_like(vc) if dq is not None else None
        for r0 in range(0, sq, rows_per):
            r1 = min(r0 + rows_per, sq)
            rows = torch.arange(r0, r1, device=q.device)
            lo, hi = _row_bounds(rows, sq, sk, mask)
            k0 = int(lo[0])
            k1 = max(int(hi[-1]), k0)
            if k1 == k0:
                continue
            cols = torch.arange(k0, k1, device=q.device)
            keep = (cols >= lo[:, None]) & (cols < hi[:, None])
            qc = q[r0:r1, h0:h1].to(cdt)
            doc = do[r0:r1, h0:h1].to(cdt)
            s, t = _scores(qc, kc[k0:k1], score_scale, softcap)
            heads = torch.arange(h0, h1, device=q.device)
            raw = s
            s, keep, slope = _apply_mods(mods, s, keep, b, heads, rows, cols, slope=dq is not None)
            s.masked_fill_(~keep, -math.inf)
            p = (s - lse[h0:h1, r0:r1, None]).exp_()
            dp = torch.einsum("rhd,khd->hrk", doc, vc[k0:k1]) * out_scale
            ds = p * (dp - delta[h0:h1, r0:r1, None])
            if softcap:
                ds = ds * (1 - t * t)
            if daux is not None:
                _aux_grads(mods, raw, ds, b, heads, rows, cols, daux)
            if dq is None:
                continue
            if slope is not None:  # through score_mod (0 where masked: its slope may be anything there)
                ds = ds * torch.where(keep, slope, torch.zeros_like(slope))
            dq[r0:r1, h0:h1] += torch.einsum("hrk,khd->rhd", ds, kc[k0:k1]) * score_scale
            dkc[k0:k1] += torch.einsum("hrk,rhd->khd", ds, qc) * score_scale
            dvc[k0:k1] += torch.einsum("hrk,rhd->khd", p, doc) * out_scale
        if dq is None:
            continue
        # a K/V head's gradient is the sum over the query heads that read it
        dk.index_add_(1, kv_heads, dkc)
        dv.index_add_(1, kv_heads, dvc)


def _aux_grads(mods: CallMods, raw, ds_mod, b: int, heads, rows, cols, daux) -> None:
    """daux[i] += sum over the chunk of ``ds_mod`` (the gradient of the modded scores; 0 where
    masked) times d score_mod(raw) / d aux[i], for the accumulators that are not None."""
    leaves = tuple(a.detach().to(acc.dtype).requires_grad_() if acc is not None else a
                   for a, acc in zip(mods.aux, daux))
    wanted = [(leaf, acc) for leaf, acc in zip(leaves, daux) if acc is not None]
    with torch.enable_grad():
        y = call_score_mod(mods.score_mod, mods.score_mod.fn, raw, *_mod_positions(b, heads, rows, cols), leaves)
        y = torch.as_tensor(y, dtype=raw.dtype, device=raw.device).expand(raw.shape)
        grads = torch.autograd.grad(y, [leaf for leaf, _ in wanted], ds_mod.nan_to_num(0.0), allow_unused=True)
    for (_, acc), g in zip(wanted, grads):
        if g is not None:
            acc += g


def aux_gradients(dout, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, *, mods: CallMods, needs,
                  mask: MaskSpec = MaskSpec(), softmax_scale=None, scale_q=1.0, scale_k=1.0, scale_v=1.0,
                  inv_scale_o=1.0, dlse=None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list:
    """The gradients of ``mods``' aux tensors where ``needs[i]`` (else None), in their dtypes:
    sum over the kept scores of dS * d score_mod / d aux[i] (autograd through the mod, in fp32, fp64
    for fp64 inputs, the backward's chunks; P from the saved LSE). Layouts as in ``attention_backward_reference``."""
    score_scale, out_scale = _scales(q.shape[-1], softmax_scale, scale_q, scale_k, scale_v, inv_scale_o)
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    daux = [torch.zeros(a.shape, dtype=cdt, device=a.device) if need else None for a, need in zip(mods.aux, needs)]
    if mods.score_mod is not None:
        for b, (iq, ik, il) in enumerate(_sequences(q.shape[0], cu_seqlens_q, cu_seqlens_k)):
            _grad_sequence(dout[iq], q[iq], k[ik], v[ik], out[iq], lse[il], None if dlse is None else dlse[il],
                           None, None, None, mask, score_scale, out_scale, cdt, chunk_bytes, mods=mods, b=b,
                           daux=daux)
    return [None if g is None else g.to(a.dtype) for g, a in zip(daux, mods.aux)]


def lse_delta(out: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor]) -> torch.Tensor:
    """delta = rowsum(dO * O) - dLSE in fp32, laid out like the LSE: (B, H, S) from (B, S, H, D)
    tensors, (H, T) from (T, H, D) ones."""
    delta = (dout.float() * out.float()).sum(-1).movedim(-1, -2)
    return delta if dlse is None else delta - dlse.float()


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """dsinks[h] = -sum over the rows of head h of P_sink * delta, P_sink = exp(sinks[h] - lse)
    (docs/semantics.md); ``lse``/``delta`` laid out like the LSE, (B, H, S) or (H, T). In fp64 when
    ``sinks`` or ``lse`` is, else fp32 (the callers cast into their output)."""
    cdt = torch.float64 if torch.float64 in (sinks.dtype, lse.dtype) else torch.float32
    per_row = (sinks.to(cdt)[:, None] - lse.to(cdt)).exp() * delta.to(cdt)
    return -per_row.movedim(-2, 0).reshape(len(sinks), -1).sum(-1)


def attention_backward_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: Optional[torch.Tensor] = None,
    cu_seqlens_k: Optional[torch.Tensor] = None,
    *,
    mask: MaskSpec = MaskSpec(),
    softmax_scale: Optional[float] = None,
    scale_q: float = 1.0,
    scale_k: float = 1.0,
    scale_v: float = 1.0,
    inv_scale_o: float = 1.0,
    softcap: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
    dlse: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    mods: Optional[CallMods] = None,
):
    """Gradients of ``attention_reference``'s O (and LSE, through ``dlse``) with respect to q, k
    and v, from the forward's ``out`` and ``lse``: ``(dq, dk, dv)`` in ``compute_dtype``, shaped
    like q, k, v, and with ``sinks`` ``(dq, dk, dv, dsinks)``. Layouts and argument meanings as in
    ``attention_reference``; deterministic."""
    score_scale, out_scale = _scales(q.shape[-1], softmax_scale, scale_q, scale_k, scale_v, inv_scale_o)
    dq, dk, dv = (torch.zeros(t.shape, dtype=compute_dtype, device=q.device) for t in (q, k, v))
    sinks_c = None if sinks is None else sinks.to(compute_dtype)
    dsinks = None if sinks is None else torch.zeros(sinks.shape, dtype=compute_dtype, device=q.device)
    for b, (iq, ik, il) in enumerate(_sequences(q.shape[0], cu_seqlens_q, cu_seqlens_k)):
        _grad_sequence(dout[iq], q[iq], k[ik], v[ik], out[iq], lse[il], None if dlse is None else dlse[il],
                       dq[iq], dk[ik], dv[ik], mask, score_scale, out_scale, compute_dtype, chunk_bytes, softcap,
                       sinks_c, dsinks, mods, b)
    return (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)
