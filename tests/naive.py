"""A deliberately simple fp64 attention, written from docs/semantics.md without fmha's code: the full
score matrix per (sequence, head), the mask as an explicit (i, j) predicate."""

import math

import torch


def keep_matrix(sq, sk, mask):
    """The semantics' predicate for every (i, j). ``mask`` is a dict: kind in {"none", "window",
    "compressed"}, left, right (None = unbounded), bottom_right."""
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if mask["kind"] == "compressed":
        c = sq // sk
        return keep & (j <= (i + 1) // c - 1)
    if mask["kind"] == "window":
        off = sk - sq if mask.get("bottom_right") else 0
        if mask.get("left") is not None:
            keep &= j >= i + off - mask["left"]
        if mask.get("right") is not None:
            keep &= j <= i + off + mask["right"]
    return keep


def naive_sequence(q, k, v, mask, softmax_scale=None, scale_q=1.0, scale_k=1.0, scale_v=1.0,
                   inv_scale_o=1.0, round_p_fp8=None, softcap=0.0, sinks=None):
    """q (S_q, H_q, D), k/v (S_k, H_k, D_v). Returns O (S_q, H_q, D_v) and LSE (H_q, S_q), fp64;
    differentiable (autograd) in q, k, v and ``sinks`` (H_q,)."""
    sq, hq, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    if softmax_scale is None:
        softmax_scale = 1 / math.sqrt(d)
    if round_p_fp8 is None:
        round_p_fp8 = q.dtype == torch.float8_e4m3fn
    o = torch.zeros(sq, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, sq), -math.inf, dtype=torch.float64)
    keep = keep_matrix(sq, sk, mask) if sq and sk else torch.zeros(sq, sk, dtype=torch.bool)
    for h in range(hq):
        kvh = h // (hq // hk)
        qh = q[:, h].double()
        kh = k[:, kvh].double()
        vh = v[:, kvh].double()
        for i in range(sq):
            cols = keep[i].nonzero().flatten()
            if len(cols) == 0:
                if sinks is not None:  # the sink alone: O = 0, LSE = the sink
                    lse[h, i] = sinks[h].double()
                continue
            s = (kh[cols] @ qh[i]) * softmax_scale * scale_q * scale_k
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            m = s.max()
            if sinks is not None:
                m = torch.maximum(m, sinks[h].double())
            p = torch.exp(s - m)
            total = p.sum()
            if sinks is not None:
                total = total + torch.exp(sinks[h].double() - m)
            if round_p_fp8:
                p = p.to(torch.float8_e4m3fn).double()
            o[i, h] = (p @ vh[cols]) / total * scale_v * inv_scale_o
            lse[h, i] = m + torch.log(total)
    return o, lse


def naive_attention(q, k, v, mask, cu_q=None, cu_k=None, **kw):
    """Dense (B, S, H, D), or varlen (T, H, D) with cu_seqlens as lists; laid out like the
    reference's results."""
    if cu_q is None:
        outs = [naive_sequence(q[b], k[b], v[b], mask, **kw) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([l for _, l in outs])
    outs = [naive_sequence(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]],
                           v[cu_k[b]:cu_k[b + 1]], mask, **kw) for b in range(len(cu_q) - 1)]
    return torch.cat([o for o, _ in outs]), torch.cat([l for _, l in outs], dim=1)


def naive_mask(causal=False, window_size=(None, None), mask_align="top_left",
               compressed_causal=False):
    """The public keyword arguments as the predicate's dict."""
    if compressed_causal:
        return {"kind": "compressed"}
    left, right = window_size
    if causal:
        right = 0 if right is None else min(right, 0)
    return {"kind": "window", "left": left, "right": right,
            "bottom_right": mask_align == "bottom_right"}
