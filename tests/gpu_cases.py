"""The GPU check's cases and verdicts: the matrix of configurations ``tests/test_gpu_kernels.py``
runs on a GPU (``python -m pytest -m gpu``), and how one case is judged.

Every case draws fresh random inputs, poisons the outputs (and guard rows around them) with NaN,
runs the kernel, and compares with ``fmha.reference`` in fp32 on the same inputs: relative L2
error of O, max |LSE| error on finite rows, exact -inf/zero rows where nothing is kept, guard rows
untouched. The verdicts themselves are tested on the CPU (``tests/test_gpu_cases.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import traceback
from dataclasses import dataclass, replace
from typing import Optional

O_TOL = {"bfloat16": 1e-2, "float16": 5e-3}
FP8_TOL = 5e-2  # fp8 inputs (any output dtype): against the reference on the same fp8 values
LSE_TOL = 1e-3
# Hopper's fp8 MMAs accumulate with fewer mantissa bits than fp32 (observed LSE error up to
# 1.5e-3 at D=256 on the H200, where the scores sum 256 products): a looser LSE bound for fp8.
LSE_TOL_FP8 = 5e-3
GUARD = 3  # poisoned rows after each sequence's output that must stay NaN


@dataclass(frozen=True)
class Case:
    dtype: str
    head_dim: int
    mask: str  # none | causal | window | compressed
    align: str = "top_left"
    window: tuple = (None, None)
    lse: bool = True
    persistent: bool = True
    batch: int = 1
    seqlen_q: int = 128
    seqlen_k: int = 128
    heads_q: int = 1
    heads_k: int = 1
    varlen_q: Optional[tuple] = None  # per-sequence lengths (varlen cases)
    varlen_k: Optional[tuple] = None
    layout: str = "bshd"  # bshd | bhsd (a transposed view)
    out_dtype: Optional[str] = None
    tile_m: Optional[int] = None  # None: the backend's default for the head dim
    scales: Optional[tuple] = None  # (scale_q, scale_k, scale_v, inv_scale_o), default all 1
    lens_unread: bool = False  # varlen as FusedAttention.execute(check=False) runs it
    # varlen with the lengths not read on the host (max lengths given): the GPU lists the tiles
    tiles_on_device: bool = False
    # "randn", or "rising": keys scaled up along the sequence, with two spiked keys, so that
    # rows' maxima jump by more than the softmax's slack (``OnlineSoftmax.max_slack``) mid-row
    scores: str = "randn"
    # with persistent=False: persistent CTAs that claim the tiles in the one-CTA-per-tile order
    # (``KernelOptions.claim_tiles``)
    claim: bool = False
    # backward cases: deterministic=True, checked bitwise-repeatable as well
    deterministic: bool = False

    def name(self):
        shape = (f"varlen q{list(self.varlen_q)} k{list(self.varlen_k)}" if self.varlen_q
                 else f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k}")
        if self.varlen_q and len(self.varlen_q) > 8:
            shape = (f"varlen {len(self.varlen_q)} sequences, q T{sum(self.varlen_q)} max{max(self.varlen_q)}, "
                     f"k T{sum(self.varlen_k)} max{max(self.varlen_k)}")
        mask = self.mask
        if self.mask in ("causal", "window"):
            mask += f"({self.align}" + (f",{self.window}" if self.mask == "window" else "") + ")"
        return (f"{self.dtype} D{self.head_dim} {mask} {shape} H{self.heads_q}/{self.heads_k} "
                f"lse={int(self.lse)} pers={int(self.persistent)} {self.layout}"
                + (f" out={self.out_dtype}" if self.out_dtype else "")
                + (f" scales={self.scales}" if self.scales else "")
                + (" lens_unread" if self.lens_unread else "")
                + (" tiles_on_device" if self.tiles_on_device else "")
                + (f" scores={self.scores}" if self.scores != "randn" else "")
                + (f" tile_m={self.tile_m}" if self.tile_m else "")
                + (" claim" if self.claim else "")
                + (" deterministic" if self.deterministic else ""))


def mask_kwargs(case: Case) -> dict:
    """The public API's mask keywords for this case."""
    if case.mask == "none":
        return {}
    if case.mask == "causal":
        return dict(causal=True, mask_align=case.align)
    if case.mask == "window":
        return dict(window_size=case.window, mask_align=case.align)
    return dict(compressed_causal=True)


def build_suite(name: str) -> list[Case]:
    cases = []
    shapes = [  # (B, S_q, S_k, H_q, H_k): odd sizes, S_q != S_k both ways, GQA 1/2/8
        (1, 1, 1, 1, 1),
        (3, 17, 17, 2, 1),
        (1, 128, 129, 8, 8),
        (3, 129, 1000, 8, 1),
        (1, 1000, 129, 2, 2),
        (3, 1000, 1000, 8, 8),
        (1, 4096, 4096, 8, 1),
        (1, 17, 4096, 2, 1),
        (1, 4096, 1000, 1, 1),
    ]
    varlens = [((0, 1, 17, 300, 1024, 77), (0, 1, 17, 300, 1024, 77)),
               ((5, 0, 129, 1), (300, 7, 0, 1)),
               # sequences 1 and 3 have keys but no queries: their K/V rows are NaN-poisoned
               # (_make_inputs) and sit right after 0's and 2's last, ragged key tiles
               ((100, 0, 200, 0), (150, 20, 130, 7))]
    dtypes = ["bfloat16", "float16"]
    dims = [64, 128]
    masks = [("none", "top_left"), ("causal", "top_left"), ("causal", "bottom_right")]
    if name == "quick":
        for dt, d, (m, al) in itertools.product(["bfloat16"], dims, masks):
            for b, sq, sk, hq, hk in shapes[:4]:
                cases.append(Case(dt, d, m, al, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk))
        for dt, d in [("bfloat16", 32), ("bfloat16", 256), ("float8_e4m3fn", 64), ("float8_e4m3fn", 128),
                      ("float8_e4m3fn", 256)]:
            for b, sq, sk, hq, hk in shapes[2:6]:
                cases.append(Case(dt, d, "causal", "bottom_right", (None, 0), batch=b, seqlen_q=sq,
                                  seqlen_k=sk, heads_q=hq, heads_k=hk))
            cases.append(Case(dt, d, "none", varlen_q=varlens[0][0], varlen_k=varlens[0][1], heads_q=4, heads_k=1))
        return cases
    # The kernel issue's matrix: every dtype x head dim x mask x LSE x scheduling mode, each on
    # several shapes (rotating through the list so every shape meets every configuration kind).
    for i, (dt, d, (m, al), lse, pers) in enumerate(
        itertools.product(dtypes, dims, masks, [True, False], [True, False])
    ):
        picked = [shapes[(i + j) % len(shapes)] for j in range(0, len(shapes), 2)]
        for j, (b, sq, sk, hq, hk) in enumerate(picked):
            layout = "bhsd" if (i + j) % 5 == 0 else "bshd"
            cases.append(Case(dt, d, m, al, lse=lse, persistent=pers, batch=b, seqlen_q=sq,
                              seqlen_k=sk, heads_q=hq, heads_k=hk, layout=layout))
    # Beyond the first kernel issue: varlen, windows, compressed causal, other out dtype.
    for d, (m, al, w) in itertools.product(dims, [
        ("none", "top_left", (None, None)), ("causal", "top_left", (None, 0)),
        ("causal", "bottom_right", (None, 0)), ("window", "top_left", (100, 37)),
        ("window", "bottom_right", (64, 0)),
    ]):
        for lq, lk in varlens:
            cases.append(Case("bfloat16", d, m, al, w, varlen_q=lq, varlen_k=lk, heads_q=4, heads_k=1))
    for d, al, w in itertools.product(dims, ["top_left", "bottom_right"],
                                      [(0, 0), (64, 0), (None, 0), (100, 37), (0, None)]):
        for b, sq, sk, hq, hk in [(2, 300, 300, 4, 1), (1, 1000, 129, 4, 4), (1, 129, 1000, 2, 1)]:
            cases.append(Case("bfloat16", d, "window", al, w, batch=b, seqlen_q=sq, seqlen_k=sk,
                              heads_q=hq, heads_k=hk))
    for d, (sq, sk) in itertools.product(dims, [(300, 300), (300, 150), (1024, 64), (1000, 31)]):
        cases.append(Case("bfloat16", d, "compressed", batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=4, heads_k=1))
    cases.append(Case("float16", 128, "causal", out_dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=300, heads_q=2, heads_k=2))
    for m, al in [("none", "top_left"), ("causal", "bottom_right")]:  # the non-default D=64 tile
        cases.append(Case("bfloat16", 64, m, al, tile_m=128, batch=2, seqlen_q=1000, seqlen_k=777, heads_q=4, heads_k=2))
    cases += coverage_cases(shapes, varlens)
    # Every one-CTA-per-tile case whose mask gives later query tiles more work, again with
    # persistent CTAs claiming those tiles (the library's choice for such problems when their
    # K/V would not stay in L2; these small ones run it because the option asks).
    causal_like = ("causal", "compressed")
    cases += [replace(c, claim=True) for c in cases
              if not c.persistent and c.varlen_q is None
              and (c.mask in causal_like or (c.mask == "window" and c.window[0] is None))]
    return cases


def coverage_cases(shapes, varlens) -> list[Case]:
    """Head dims 32 and 256, fp8 inputs (every head dim), fp8 output, the fp8 scale factors:
    each crossed with masks, alignments, GQA 1/4, varlen and scheduling modes."""
    cases = []
    masks = [("none", "top_left", (None, None)), ("causal", "top_left", (None, 0)),
             ("causal", "bottom_right", (None, 0))]
    new = [(dt, d) for dt in ("bfloat16", "float16") for d in (32, 256)]
    new += [("float8_e4m3fn", d) for d in (32, 64, 128, 256)]
    for i, ((dt, d), (m, al, w), pers) in enumerate(itertools.product(new, masks, [True, False])):
        for j in range(0, len(shapes), 3):
            b, sq, sk, hq, hk = shapes[(i + j) % len(shapes)]
            cases.append(Case(dt, d, m, al, w, lse=(i + j) % 3 != 0, persistent=pers, batch=b,
                              seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk,
                              layout="bhsd" if (i + j) % 4 == 0 else "bshd"))
    extra_masks = masks + [("window", "top_left", (100, 37)), ("window", "bottom_right", (64, 0))]
    for (dt, d), (m, al, w) in itertools.product(new, extra_masks):
        if dt == "float16":
            continue
        for lq, lk in varlens:
            cases.append(Case(dt, d, m, al, w, varlen_q=lq, varlen_k=lk, heads_q=4, heads_k=1))
    for (dt, d), al, w in itertools.product([("bfloat16", 32), ("bfloat16", 256), ("float8_e4m3fn", 64),
                                              ("float8_e4m3fn", 128)],
                                             ["top_left", "bottom_right"],
                                             [(0, 0), (64, 0), (None, 0), (100, 37), (0, None)]):
        for b, sq, sk, hq, hk in [(2, 300, 300, 4, 1), (1, 129, 1000, 1, 1)]:
            cases.append(Case(dt, d, "window", al, w, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk))
    for (dt, d), (sq, sk) in itertools.product([("bfloat16", 32), ("bfloat16", 256), ("float8_e4m3fn", 128)],
                                               [(300, 300), (1024, 64), (1000, 31)]):
        cases.append(Case(dt, d, "compressed", batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=4, heads_k=1))
    for d in (64, 128):  # fp8 output, and the seed's de/quantization factors
        for m, al, w in masks[:2]:
            cases.append(Case("float8_e4m3fn", d, m, al, w, out_dtype="float8_e4m3fn", batch=2,
                              seqlen_q=1000, seqlen_k=1000, heads_q=4, heads_k=1))
            cases.append(Case("float8_e4m3fn", d, m, al, w, out_dtype="float16", batch=2, seqlen_q=300,
                              seqlen_k=777, heads_q=2, heads_k=2, scales=(0.5, 2.0, 1.5, 0.25)))
        cases.append(Case("float8_e4m3fn", d, "causal", "bottom_right", (None, 0), out_dtype="float8_e4m3fn",
                          varlen_q=varlens[0][0], varlen_k=varlens[0][1], heads_q=4, heads_k=1,
                          scales=(2.0, 0.5, 4.0, 0.125)))
    for m, al, w in masks:
        cases.append(Case("bfloat16", 128, m, al, w, varlen_q=varlens[1][0], varlen_k=varlens[1][1],
                          heads_q=4, heads_k=2, lens_unread=True))
    for i, (m, al, w) in enumerate(masks + [("window", "top_left", (100, 37)), ("window", "bottom_right", (64, 0))]):
        for j, (lq, lk) in enumerate(varlens):
            dt, d = [("bfloat16", 128), ("float16", 64), ("float8_e4m3fn", 128), ("bfloat16", 256)][(i + j) % 4]
            cases.append(Case(dt, d, m, al, w, varlen_q=lq, varlen_k=lk, heads_q=4, heads_k=(1, 2)[(i + j) % 2],
                              persistent=(i + j) % 3 != 0, tiles_on_device=True))
    many = tuple((37 * i) % 300 for i in range(1100))  # more sequences than the listing CTA has threads
    cases.append(Case("bfloat16", 64, "causal", "top_left", (None, 0), varlen_q=many, varlen_k=many, heads_q=2,
                      heads_k=1, tiles_on_device=True))
    cases.append(Case("bfloat16", 32, "causal", "bottom_right", (None, 0), tile_m=128, batch=2,
                      seqlen_q=1000, seqlen_k=777, heads_q=4, heads_k=2))
    # Maxima that move mid-row by more than the softmax's slack, where the kernel lets the max lag
    # (16-bit inputs, D >= 128; the O rescale is then taken), and with the exact max (D=64). Not
    # fp8: there the tensor cores' fp8 accumulation puts the scores' error in proportion to their
    # size, and with keys scaled up 6-12x the LSE misses LSE_TOL_FP8 with either softmax (1.2e-2
    # to 2.7e-2; docs/performance.md).
    for (dt, d), (m, al, w), pers in itertools.product(
            [("bfloat16", 64), ("bfloat16", 128), ("float16", 128), ("bfloat16", 256)],
            masks[::2], [True, False]):
        cases.append(Case(dt, d, m, al, w, persistent=pers, batch=2, seqlen_q=300, seqlen_k=3000,
                          heads_q=4, heads_k=2, scores="rising"))
    return cases


def _make_inputs(case: Case, torch, device, data: bool = True):
    """q, k, v, cu_seqlens_q, cu_seqlens_k of the case; random (``data``), or uninitialized CPU
    tensors of the right shapes for choosing the kernel configuration."""
    dt = getattr(torch, case.dtype)
    d = case.head_dim
    gen = torch.Generator(device=device)
    gen.manual_seed(hash(case) % (2**31))

    def rand(*shape):
        if not data:
            return torch.empty(*shape, dtype=dt, device=device)
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    if case.varlen_q is not None:
        tq, tk = sum(case.varlen_q), sum(case.varlen_k)
        q, k, v = rand(tq, case.heads_q, d), rand(tk, case.heads_k, d), rand(tk, case.heads_k, d)
        cu = lambda lens: torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device=device)
        if data:
            poison_unread_keys(k, v, case.varlen_q, case.varlen_k)
        return q, k, v, cu(case.varlen_q), cu(case.varlen_k)
    b, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
    if case.layout == "bhsd":
        q = rand(b, case.heads_q, sq, d).transpose(1, 2)
        k = rand(b, case.heads_k, sk, d).transpose(1, 2)
        v = rand(b, case.heads_k, sk, d).transpose(1, 2)
    else:
        q, k, v = rand(b, sq, case.heads_q, d), rand(b, sk, case.heads_k, d), rand(b, sk, case.heads_k, d)
    if case.scores == "rising" and data:
        rise_keys(k, torch)
    return q, k, v, None, None


def rise_keys(k, torch):
    """Scale key j by 1 + 5 j / S_k and spike two keys (x12): score spreads grow along each row,
    so running maxima move by more than 2^8 on later tiles, in some rows of a warp and not others."""
    sk = k.shape[1]
    ramp = 1 + 5 * torch.arange(sk, device=k.device, dtype=torch.float32) / sk
    ramp[sk // 3] = ramp[2 * sk // 3] = 12.0
    k.copy_((k.float() * ramp.view(1, sk, 1, 1)).to(k.dtype))


def poison_unread_keys(k, v, lens_q, lens_k):
    """NaN into the K/V rows of sequences without queries: nothing may read them. A kernel whose
    loads ran past a neighbour's last key would pull them in, and 0 * NaN in P.V shows it."""
    start = 0
    for lq, lk in zip(lens_q, lens_k):
        if lq == 0 and lk > 0:
            k[start:start + lk] = math.nan
            v[start:start + lk] = math.nan
        start += lk


def _poisoned_outputs(case: Case, q, torch, out_dtype):
    """Outputs as views into NaN-filled buffers with guard rows after every sequence."""
    hq, d = case.heads_q, case.head_dim
    if case.varlen_q is not None:
        t = q.shape[0]
        obuf = torch.full((t + GUARD, hq, d), math.nan, dtype=out_dtype, device=q.device)
        lbuf = torch.full((hq, t + GUARD), math.nan, dtype=torch.float32, device=q.device)
        return obuf, obuf[:t], lbuf, lbuf[:, :t]
    b, sq = q.shape[0], q.shape[1]
    obuf = torch.full((b, sq + GUARD, hq, d), math.nan, dtype=out_dtype, device=q.device)
    lbuf = torch.full((b, hq, sq + GUARD), math.nan, dtype=torch.float32, device=q.device)
    return obuf, obuf[:, :sq], lbuf, lbuf[:, :, :sq]


def _problem(case, q, k, v, cu_q, cu_k, torch):
    """The problem exactly as the public API's validation builds it."""
    from fmha.validation import validate

    scales = {}
    if case.scales:
        scales = dict(zip(("scale_q", "scale_k", "scale_v", "inv_scale_o"), case.scales))
    problem = validate(q, k, v, varlen=case.varlen_q is not None, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, return_lse=case.lse,
                       out_dtype=getattr(torch, case.out_dtype) if case.out_dtype else None, **scales,
                       **mask_kwargs(case))
    if case.tiles_on_device:  # as validation leaves a call given max_seqlen_q/k on a GPU
        import dataclasses

        problem = dataclasses.replace(problem, seqlens_q=None, seqlens_k=None)
    return problem


def options_of(case: Case):
    """The kernel options the case pins (scheduling, tile)."""
    from fmha.problem import KernelOptions

    return KernelOptions(persistent=case.persistent, tile_m=case.tile_m, claim_tiles=case.claim or None)


def config_of(case: Case, torch):
    """The Hopper kernel configuration the library builds for the case (no GPU, no data)."""
    from fmha.kernels.hopper.config import HopperForwardConfig

    return HopperForwardConfig.from_problem(_problem(case, *_make_inputs(case, torch, "cpu", data=False), torch),
                                            options_of(case))


def run_case(runner, case: Case, torch, device="cuda") -> dict:
    from fmha.reference import attention_reference, cast_output

    device = torch.device(device)
    q, k, v, cu_q, cu_k = _make_inputs(case, torch, device)
    problem = _problem(case, q, k, v, cu_q, cu_k, torch)
    if case.lens_unread:
        import dataclasses

        problem = dataclasses.replace(problem, seqlens_q=None, seqlens_k=None)
    mask = problem.mask
    obuf, out, lbuf, lse = _poisoned_outputs(case, q, torch, problem.out_dtype)
    runner(problem, q, k, v, out, lse if case.lse else None, cu_q, cu_k)
    if device.type == "cuda":
        torch.cuda.synchronize()
    ref_o, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, mask=mask, compute_dtype=torch.float32,
        **dict(zip(("scale_q", "scale_k", "scale_v", "inv_scale_o"), case.scales or ())))
    if problem.out_dtype == torch.float8_e4m3fn:
        # Compare like with like: the reference output rounded (and saturated) as the kernel's is.
        ref_o = cast_output(ref_o, torch.float8_e4m3fn).float()
    res = {}
    o = out.float()
    res["nan_in_o"] = int(torch.isnan(o).sum())
    # guard rows must still be poison: nothing wrote past a sequence
    guard_o = obuf[q.shape[0]:] if case.varlen_q is not None else obuf[:, q.shape[1]:]
    res["guard_written"] = int((~torch.isnan(guard_o.float())).sum())
    empty_rows = torch.isneginf(ref_lse)  # rows that keep no key
    diff = (o - ref_o).nan_to_num(nan=1e30)
    ref_norm = ref_o.norm().item()
    res["o_rel_l2"] = diff.norm().item() / ref_norm if ref_norm > 0 else diff.abs().max().item() if diff.numel() else 0.0
    res["o_max_abs"] = diff.abs().max().item() if diff.numel() else 0.0
    # O of empty rows must be exactly 0
    o_rows = o.transpose(-3, -2) if case.varlen_q is None else o.transpose(0, 1)  # (.., H, S, D)
    res["empty_rows"] = int(empty_rows.sum())
    res["empty_rows_nonzero_o"] = int((o_rows[empty_rows] != 0).any(dim=-1).sum()) if res["empty_rows"] else 0
    if case.lse:
        l = lse
        res["nan_in_lse"] = int(torch.isnan(l).sum())
        res["lse_inf_mismatch"] = int((torch.isneginf(l) != empty_rows).sum())
        finite = ~empty_rows & ~torch.isnan(l)
        res["lse_max_abs"] = (l[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
        guard_l = lbuf[:, q.shape[0]:] if case.varlen_q is not None else lbuf[:, :, q.shape[1]:]
        res["guard_written"] += int((~torch.isnan(guard_l)).sum())
    tol = FP8_TOL if case.dtype == "float8_e4m3fn" else O_TOL[case.out_dtype or case.dtype]
    ok = (res["nan_in_o"] == 0 and res["guard_written"] == 0 and res["o_rel_l2"] < tol
          and res["empty_rows_nonzero_o"] == 0)
    if case.lse:
        ok = ok and res["nan_in_lse"] == 0 and res["lse_inf_mismatch"] == 0 and res["lse_max_abs"] < (LSE_TOL_FP8 if case.dtype == "float8_e4m3fn" else LSE_TOL)
    res["ok"] = bool(ok)
    return res


STAGE_V_CASES = [(d, kind, spec) for d in (32, 64, 128, 256) for kind, spec in (
    ("dense", dict(b=2, s=77, h=3)), ("dense", dict(b=1, s=4096, h=4)), ("bhsd view", dict(b=2, s=300, h=2)),
    ("varlen", dict(lens=(0, 1, 17, 300, 33, 0), h=3)))]


def stage_v_name(d, kind, spec) -> str:
    return f"stage_v float8_e4m3fn D{d} {kind} " + ",".join(f"{k}={v}" for k, v in spec.items())


def check_stage_v(d, kind, spec, torch, device="cuda") -> dict:
    """fp8 V staging: the GPU kernel (``stage_v_fp8``) against the torch ops
    (``stage_v_fp8_torch``), byte for byte: odd lengths, padding, a transposed view, varlen with
    empty and length-1 sequences, every head dim. The block the kernel writes into is handed out
    pre-filled with 0xFF (the caching allocator reuses a freed block of the same size), so a byte
    it leaves unwritten shows up as a mismatch."""
    from fmha.kernels.hopper.v_staging import stage_v_fp8, stage_v_fp8_torch, staged_length

    gen = torch.Generator(device=device).manual_seed(7 + d)

    def fp8(*shape):
        return (torch.randn(*shape, generator=gen, device=device) * 3).to(torch.float8_e4m3fn)

    try:
        cu = None
        if kind == "varlen":
            lens = spec["lens"]
            v = fp8(sum(lens), spec["h"], d)
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=device)
            max_k, batch = max(lens), len(lens)
        elif kind == "bhsd view":
            v = fp8(spec["b"], spec["h"], spec["s"], d).transpose(1, 2)
            max_k, batch = spec["s"], spec["b"]
        else:
            v = fp8(spec["b"], spec["s"], spec["h"], d)
            max_k, batch = spec["s"], spec["b"]
        want = stage_v_fp8_torch(v, cu, max_k).view(torch.uint8)
        poison = torch.full((batch, v.shape[-2], d, staged_length(max_k)), 255, dtype=torch.uint8, device=device)
        del poison
        got = stage_v_fp8(v, cu, max_k).view(torch.uint8)
        if device != "cpu":
            torch.cuda.synchronize()
        bad = int((got != want).sum()) if got.shape == want.shape else -1
        res = dict(ok=bad == 0, mismatched_bytes=bad, o_rel_l2=float(bad != 0))
    except Exception:
        res = dict(ok=False, error=traceback.format_exc(limit=4))
    res.update(name=stage_v_name(d, kind, spec),
               case=dict(head_dim=d, kind=kind, lse=False, **{k: str(v) for k, v in spec.items()}))
    return res


def write_reports(results: list, out_dir: str, meta: dict) -> int:
    """``results.json`` (every case's numbers) and ``results.md`` (a table, failures first)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    n_ok = sum(r["ok"] for r in results)
    lines = [f"# GPU check: {n_ok}/{len(results)} cases pass", "",
             f"{meta.get('device', '?')}, {meta.get('date', '')}, command: `{meta.get('command', '')}`", "",
             "| case | O rel L2 | LSE max abs | empty rows | ok |", "|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["ok"], r["name"])):
        err = r.get("error", "").strip().splitlines()[-1:] if not r["ok"] and "error" in r else []
        lines.append(
            f"| {r['name']} | {r.get('o_rel_l2', float('nan')):.2e} | "
            f"{r.get('lse_max_abs', float('nan')) if r.get('case', {}).get('lse') else '-'} | "
            f"{r.get('empty_rows', '-')} | {'yes' if r['ok'] else 'NO ' + ' '.join(err)} |")
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return n_ok


def build_backward_suite() -> list:
    """Backward cases: both 16-bit dtypes x head dims 32/64/128/256 x every mask kind and alignment,
    rotated over odd shapes (S_q != S_k both ways, ragged tiles, GQA 1/2/4, a BHSD view)."""
    shapes = [(2, 129, 200, 4, 1), (1, 300, 300, 2, 2), (3, 17, 17, 8, 2), (1, 1000, 777, 4, 2), (2, 200, 129, 4, 4),
              (1, 1, 1, 2, 1)]
    masks = [("none", "top_left", (None, None)), ("causal", "top_left", (None, 0)),
             ("causal", "bottom_right", (None, 0)), ("window", "top_left", (100, 37)),
             ("window", "bottom_right", (64, 0)), ("window", "top_left", (0, None))]
    cases = []
    for i, (dt, d, (m, al, w)) in enumerate(itertools.product(["bfloat16", "float16"], [32, 64, 128], masks)):
        for j in range(2):
            b, sq, sk, hq, hk = shapes[(i + j) % len(shapes)]
            cases.append(Case(dt, d, m, al, w, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk,
                              layout="bhsd" if (i + j) % 5 == 0 else "bshd",
                              scales=(1.5, 0.5, 2.0, 0.75) if (i + j) % 7 == 0 else None))
    for dt, d in itertools.product(["bfloat16", "float16"], [64, 128]):
        for sq, sk in [(300, 150), (1000, 31)]:
            cases.append(Case(dt, d, "compressed", batch=2, seqlen_q=sq, seqlen_k=sk, heads_q=4, heads_k=1))
    # varlen: empty and length-1 sequences, ragged tails next to NaN-poisoned neighbours
    varlens = [((0, 1, 17, 300, 1024, 77), (0, 1, 17, 300, 1024, 77)),
               ((5, 0, 129, 1), (300, 7, 0, 1)),
               ((100, 0, 200, 0), (150, 20, 130, 7))]
    for i, (m, al, w) in enumerate(masks):
        for j, (lq, lk) in enumerate(varlens):
            dt, d = ["bfloat16", "float16"][(i + j) % 2], [32, 64, 128][(i + j) % 3]
            cases.append(Case(dt, d, m, al, w, varlen_q=lq, varlen_k=lk, heads_q=4, heads_k=(1, 2)[(i + j) % 2]))
    cases.append(Case("bfloat16", 128, "compressed", varlen_q=(300, 1, 0, 77), varlen_k=(150, 1, 0, 10),
                      heads_q=4, heads_k=2))
    # deterministic: many K/V tiles add into each query tile; the last has more CTAs than the GPU
    # holds at once (each waits only on lower block indices)
    cases += [Case("bfloat16", 128, "none", batch=2, seqlen_q=1000, seqlen_k=777, heads_q=4, heads_k=2,
                   deterministic=True),
              Case("float16", 64, "causal", "bottom_right", (None, 0), seqlen_q=3000, seqlen_k=2000, heads_q=8,
                   heads_k=2, deterministic=True),
              Case("bfloat16", 128, "window", "top_left", (100, 37), varlen_q=varlens[0][0], varlen_k=varlens[0][1],
                   heads_q=4, heads_k=1, deterministic=True),
              Case("float16", 32, "compressed", batch=2, seqlen_q=1000, seqlen_k=31, heads_q=4, heads_k=1,
                   deterministic=True),
              Case("bfloat16", 128, "causal", "top_left", (None, 0), seqlen_q=8192, seqlen_k=8192, heads_q=16,
                   heads_k=16, deterministic=True)]
    # D=256 (``split_head_dim``: 64-key tiles, one Q/dO stage, P^T and dS^T through shared memory):
    # every mask and alignment over the odd shapes, GQA, varlen with empty and length-1
    # sequences, the scales, deterministic
    for i, ((m, al, w), dt) in enumerate(itertools.product(masks, ["bfloat16", "float16"])):
        b, sq, sk, hq, hk = shapes[i % len(shapes)]
        cases.append(Case(dt, 256, m, al, w, batch=b, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_k=hk,
                          layout="bhsd" if i % 5 == 0 else "bshd",
                          scales=(1.5, 0.5, 2.0, 0.75) if i % 4 == 1 else None))
    cases += [Case("bfloat16", 256, "compressed", batch=2, seqlen_q=300, seqlen_k=150, heads_q=4, heads_k=1),
              Case("float16", 256, "causal", "bottom_right", (None, 0), varlen_q=varlens[1][0],
                   varlen_k=varlens[1][1], heads_q=4, heads_k=2),
              Case("bfloat16", 256, "none", varlen_q=varlens[0][0], varlen_k=varlens[0][1], heads_q=2, heads_k=1),
              Case("bfloat16", 256, "window", "top_left", (100, 37), varlen_q=varlens[2][0], varlen_k=varlens[2][1],
                   heads_q=4, heads_k=4),
              Case("bfloat16", 256, "causal", "top_left", (None, 0), batch=2, seqlen_q=1000, seqlen_k=777, heads_q=4,
                   heads_k=2, deterministic=True),
              Case("float16", 256, "none", batch=1, seqlen_q=2049, seqlen_k=3000, heads_q=8, heads_k=8)]
    # D=128 without a mask from LONG_ROWS query rows: 80-row tiles, dQ transposed (ragged last tiles)
    cases += [Case("bfloat16", 128, "none", seqlen_q=4099, seqlen_k=4300, heads_q=2, heads_k=1),
              Case("float16", 128, "none", varlen_q=(4097, 0, 1, 300), varlen_k=(4200, 5, 1, 77), heads_q=4,
                   heads_k=2),
              Case("bfloat16", 128, "none", batch=2, seqlen_q=4096, seqlen_k=1000, heads_q=2, heads_k=2,
                   deterministic=True)]
    return cases


BACKWARD_TOL = {"bfloat16": 2e-2, "float16": 1e-2}


def backward_config(case: Case, torch):
    """The Hopper backward configuration of a backward case (no GPU, no data)."""
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.problem import KernelOptions

    q, k, v, cu_q, cu_k = _make_inputs(case, torch, "cpu", data=False)
    problem = _problem(case, q, k, v, cu_q, cu_k, torch)
    return HopperBackwardConfig.from_problem(problem, KernelOptions(deterministic=case.deterministic))


@contextlib.contextmanager
def _poisoned_dq_accumulator(torch):
    """The Hopper backward's fp32 dQ accumulator handed out filled with NaN: a row the row pass
    fails to zero turns dQ to NaN."""
    from fmha.kernels.hopper.backward_runner import HopperBackwardRunner

    plain = HopperBackwardRunner.dq_accumulator

    def poisoned(self, problem, q):
        return plain(self, problem, q).fill_(math.nan)

    HopperBackwardRunner.dq_accumulator = poisoned
    try:
        yield
    finally:
        HopperBackwardRunner.dq_accumulator = plain


def run_backward_case(case: Case, torch, device="cuda", backend="kernel") -> dict:
    """The backward of ``case`` through ``fmha.attention_backward`` against the fp32 reference
    backward on the same inputs, out and LSE: relative L2 error of dq, dk, dv (poisoned with NaN
    first, and so is the kernel's fp32 dQ accumulator, which the row pass must zero), a gradient on
    the LSE included."""
    import fmha
    from fmha.reference import attention_backward_reference, attention_reference, cast_output

    device = torch.device(device)
    q, k, v, cu_q, cu_k = _make_inputs(case, torch, device)
    problem = _problem(case, q, k, v, cu_q, cu_k, torch)
    scales = dict(zip(("scale_q", "scale_k", "scale_v", "inv_scale_o"), case.scales or ()))
    out, lse = attention_reference(q, k, v, cu_q, cu_k, mask=problem.mask, **scales)
    out = cast_output(out, q.dtype)
    gen = torch.Generator(device=device).manual_seed(hash(case) % (2**31) + 1)
    dout = torch.randn(out.shape, generator=gen, device=device).to(q.dtype)
    dlse = torch.randn(lse.shape, generator=gen, device=device).masked_fill(torch.isneginf(lse), 0)
    want = attention_backward_reference(dout, q, k, v, out, lse, cu_q, cu_k, mask=problem.mask, dlse=dlse,
                                        **scales)
    def run():
        grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
        with _poisoned_dq_accumulator(torch) if device.type == "cuda" else contextlib.nullcontext():
            fmha.attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, dlse=dlse, dq=grads[0], dk=grads[1],
                                    dv=grads[2], deterministic=case.deterministic, backend=backend, **scales,
                                    **mask_kwargs(case))
        if device.type == "cuda":
            torch.cuda.synchronize()
        return grads

    grads = run()
    res = {}
    if case.deterministic:  # bitwise the same, run after run
        res["repeatable"] = all(all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(grads, again))
                                for again in (run(), run()))
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        g = got.float()
        res[f"nan_in_{name}"] = int(torch.isnan(g).sum())
        norm = ref.norm().item()
        diff = (g - ref).nan_to_num(nan=1e30).norm().item()
        res[f"{name}_rel_l2"] = diff / norm if norm > 0 else diff
    tol = BACKWARD_TOL[case.dtype]
    res["o_rel_l2"] = max(res[f"{n}_rel_l2"] for n in ("dq", "dk", "dv"))
    res["ok"] = bool(all(res[f"nan_in_{n}"] == 0 for n in ("dq", "dk", "dv")) and res["o_rel_l2"] < tol
                     and res.get("repeatable", True))
    return res


def capture_graph(step, torch):
    """A CUDA graph of ``step``, after one eager call on a side stream (which loads the kernels
    and sets up the device error flag, as a capture needs; the outputs hold its results)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _compile_into(cache_dir: str, cfg):
    """Worker: compile ``cfg`` (forward or backward) into the disk cache at ``cache_dir``."""
    import os
    import time

    os.environ["FMHA_CACHE_DIR"] = cache_dir
    from fmha.jit import disk_cache
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.forward_runner import compile_forward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig

    start = time.time()
    disk_cache.load_or_compile(cfg, compile_backward if isinstance(cfg, HopperBackwardConfig) else compile_forward)
    return time.time() - start


def compile_all(configs, cache_dir: str, workers: int):
    """Compile Hopper kernel configurations into the disk cache at ``cache_dir``, in parallel
    worker processes."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_compile_into, [(cache_dir, cfg) for cfg in configs])
