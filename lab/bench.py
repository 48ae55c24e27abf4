"""Side-by-side forward-attention benchmark on one GPU: fmha against the peers importable there.

    python -m lab.bench                        # the standard grid + extras, writes results/bench/
    python -m lab.bench --grid standard        # the 24 points of the standard grid only
    python -m lab.bench --grid quick           # a handful of points
    python -m lab.bench --variants --impls fmha_same_path,fmha_q1   # compile-time choices (lab/variants.py)
    python -m lab.bench --compile-workers 14 ...  # compile the grid's kernels in 14 processes first

Peers: FlashAttention-4 (``flash_attn.cute.flash_attn_func``), PyTorch SDPA with the cuDNN and the
flash backends; where FlashAttention-3's prebuilt forward (``fa3_fwd_interface``) and the cuDNN
frontend are importable, FlashAttention-3 (``fa3``) and cuDNN's fp8 graph (``cudnn_fp8``, fp8
output).

Every implementation's output is checked against the fp32 reference on the same
inputs before it is timed (a wrong answer is reported, not timed). Timing: CUDA events through
``triton.testing.do_bench`` (median), after a warm-up call that compiles. TFLOP/s =
4 * B * H_q * S_q * S_k * D / time, halved for causal with S_q == S_k (the usual convention).
Writes ``bench.json``, ``bench.md`` and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from typing import Callable

from lab.bench_grid import Point, build_grid, extras_grid
from lab.bench_report import write_reports

REL_L2_LIMIT = 2e-2  # bf16 outputs against the fp32 reference
FP8_REL_L2_LIMIT = 5e-2  # fp8 inputs: against the reference on the same fp8 values
FP8_OUT_REL_L2_LIMIT = 1e-1  # and an fp8 output (cuDNN's): e4m3's rounding of O adds about 3.6% RMS
FP8_OUTPUT_IMPLS = ("cudnn_fp8",)
#: fmha through its public API (the rest of the ``fmha_*`` names are lab/variants.py's)
LIBRARY_IMPLS = ("fmha", "fmha_new_offsets", "fmha_unchecked", "fmha_deterministic")


def _mask_kwargs(p: Point) -> dict:
    if p.window_left is not None:
        return dict(window_size=(p.window_left, 0))
    return dict(causal=p.causal)


def _implementations(torch, variants: bool = False, peers: bool = True) -> dict[str, Callable]:
    """name -> fn(q, k, v, point, cu_seqlens) on BSHD (or THD) tensors, for the peers importable
    here (``peers=False``: fmha's own only). A peer that cannot run a point raises; the row then
    records why."""
    import fmha

    def ours(q, k, v, p, cu):
        if p.varlen:  # one offsets tensor, read on the host once (exact tile list)
            return fmha.attention_varlen(q, k, v, cu, cu, backend="kernel", **_mask_kwargs(p))
        return fmha.attention(q, k, v, backend="kernel", **_mask_kwargs(p))

    prepared = {}

    def ours_unchecked(q, k, v, p, cu):
        """FusedAttention.execute(check=False): no host read of cu_seqlens, so no sync per
        call (what a training loop or a CUDA graph would use once inputs are known good)."""
        if not p.varlen:
            raise NotImplementedError("timed on varlen points (dense calls never sync)")
        if p not in prepared:
            m = max(p.varlen)
            o = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.bfloat16, device=q.device)
            fa = fmha.FusedAttention(q, k, v, o, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                     max_seqlen_k=m, backend="kernel", **_mask_kwargs(p))
            fa.compile()
            prepared[p] = (fa, o)
        fa, o = prepared[p]
        fa.execute(q, k, v, o, None, cu, cu, check=False)
        return o

    def ours_new_offsets(q, k, v, p, cu):
        """The public API given a new cu_seqlens tensor every call, as a training loop's packed
        batches are, with max_seqlen_q/k: nothing is read back (the offsets are checked on the
        device), and the tile list covers every query tile up to the max length. ``fmha`` reuses
        one tensor and reads it once on the host (fmha.validation)."""
        if not p.varlen:
            raise NotImplementedError("timed on varlen points (dense calls never sync)")
        m = max(p.varlen)
        return fmha.attention_varlen(q, k, v, cu.clone(), cu.clone(), m, m, backend="kernel", **_mask_kwargs(p))

    def ours_deterministic(q, k, v, p, cu):
        """deterministic=True: the backward adds dQ in K/V tile order (timed in --backward)."""
        if p.varlen:
            return fmha.attention_varlen(q, k, v, cu, cu, backend="kernel", deterministic=True, **_mask_kwargs(p))
        return fmha.attention(q, k, v, backend="kernel", deterministic=True, **_mask_kwargs(p))

    impls: dict[str, Callable] = {"fmha": ours, "fmha_new_offsets": ours_new_offsets,
                                  "fmha_unchecked": ours_unchecked, "fmha_deterministic": ours_deterministic}
    assert set(impls) == set(LIBRARY_IMPLS)
    if variants:
        from lab.variants import BACKWARD_VARIANTS, VARIANTS, backward_variant, kernel_variant

        for name, overrides in VARIANTS.items():
            impls[name] = kernel_variant(_mask_kwargs, **overrides)
        for name, overrides in BACKWARD_VARIANTS.items():
            impls[name] = backward_variant(_mask_kwargs, **overrides)
    if not peers:
        return impls
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        def fa4(q, k, v, p, cu):
            if p.dtype != "bfloat16":
                raise NotImplementedError("FA4 has no fp8 forward on SM90")
            window = (p.window_left, 0) if p.window_left is not None else (None, None)
            causal = p.causal and p.window_left is None
            if p.varlen:
                m = max(p.varlen)
                out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                             max_seqlen_k=m, causal=causal, window_size=window)
            else:
                out = flash_attn_func(q, k, v, causal=causal, window_size=window)
            return out[0] if isinstance(out, tuple) else out

        impls["fa4"] = fa4
    except Exception as e:  # not importable on this machine
        print(f"FlashAttention-4 not available: {e}", file=sys.stderr)
    try:  # FA3's prebuilt forward, where it is importable
        import fa3_fwd_interface as fa3

        def fa3_forward(q, k, v, p, cu):
            if p.window_left is not None:
                raise NotImplementedError("the FA3 forward package has no sliding window")
            if p.varlen:
                m = max(p.varlen)
                out = fa3.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=p.causal)
            else:
                out = fa3.flash_attn_func(q, k, v, causal=p.causal)
            return out[0] if isinstance(out, tuple) else out

        impls["fa3"] = fa3_forward
    except ImportError:
        pass
    try:  # the cuDNN frontend from the same peers bundle: its fp8 SDPA graph (Hopper writes fp8 O)
        import cudnn

        impls["cudnn_fp8"] = _cudnn_fp8_peer(cudnn, torch)
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def sdpa(backend):
        def fn(q, k, v, p, cu):
            if p.varlen or p.window_left is not None or p.dtype != "bfloat16":
                raise NotImplementedError("SDPA takes dense bf16 with is_causal only")
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=p.causal, enable_gqa=qt.shape[1] != kt.shape[1]
                ).transpose(1, 2)
        return fn

    impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return impls


def _cudnn_fp8_peer(cudnn, torch) -> Callable:
    """cuDNN's fp8 SDPA forward (the frontend graph's ``sdpa_fp8``) on BSHD e4m3 tensors, unit
    descales of q, k, v and O, P scaled by 448 (e4m3's largest value), fp8 output (what Hopper
    offers); one graph per point, built on first use."""
    built = {}
    fp8, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT

    def build(p: Point, q, k, v):
        handle = cudnn.create_handle()
        graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)

        def bhsd(name, t):  # a BSHD tensor described as (B, H, S, D)
            return graph.tensor(name=name, dim=[t.shape[0], t.shape[2], t.shape[1], t.shape[3]],
                                stride=[t.stride(0), t.stride(2), t.stride(1), t.stride(3)], data_type=fp8)

        tq, tk, tv = bhsd("q", q), bhsd("k", k), bhsd("v", v)
        scalars = [graph.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
                   for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")]
        to, _, amax_s, amax_o = graph.sdpa_fp8(q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1],
                                               descale_v=scalars[2], descale_s=scalars[3], scale_s=scalars[4],
                                               scale_o=scalars[5], is_inference=True,
                                               attn_scale=1.0 / p.head_dim ** 0.5, use_causal_mask=p.causal)
        out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
        to.set_output(True).set_dim([out.shape[0], out.shape[2], out.shape[1], out.shape[3]]).set_stride(
            [out.stride(0), out.stride(2), out.stride(1), out.stride(3)]).set_data_type(fp8)
        amaxes = [torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device) for _ in range(2)]
        for t in (amax_s, amax_o):
            t.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        ones = torch.ones(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        pack = {t: ones for t in scalars}
        # P in [0, 1] is scaled to e4m3's range before it is rounded (at unit scale the P of rows
        # longer than ~500 keys would sink below its smallest value), and descaled after P V
        pack[scalars[4]] = torch.full((1, 1, 1, 1), 448.0, dtype=torch.float32, device=q.device)
        pack[scalars[3]] = torch.full((1, 1, 1, 1), 1 / 448.0, dtype=torch.float32, device=q.device)
        pack.update({to: out, amax_s: amaxes[0], amax_o: amaxes[1]})
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=q.device)
        return graph, handle, (tq, tk, tv), pack, workspace, out

    def cudnn_fp8(q, k, v, p, cu):
        if p.dtype != "float8_e4m3fn" or p.varlen or p.window_left is not None:
            raise NotImplementedError("cuDNN's fp8 SDPA is timed on dense fp8 points")
        if p not in built:
            built[p] = build(p, q, k, v)
        graph, handle, (tq, tk, tv), pack, workspace, out = built[p]
        graph.execute({**pack, tq: q, tk: k, tv: v}, workspace, handle=handle)
        return out

    return cudnn_fp8


def _inputs(p: Point, torch):
    dev = torch.device("cuda")
    dt = getattr(torch, p.dtype)
    rows = (sum(p.varlen),) if p.varlen else (p.batch, p.seqlen)
    q = torch.randn(*rows, p.heads_q, p.head_dim, device=dev).to(dt)
    k = torch.randn(*rows, p.heads_k, p.head_dim, device=dev).to(dt)
    v = torch.randn(*rows, p.heads_k, p.head_dim, device=dev).to(dt)
    cu = None
    if p.varlen:
        cu = torch.tensor([0, *__import__("itertools").accumulate(p.varlen)], dtype=torch.int32, device=dev)
    return q, k, v, cu


def _reference(p: Point, q, k, v, cu, torch):
    from fmha.masking import MaskSpec
    from fmha.reference import attention_reference

    mask = MaskSpec.from_args(**_mask_kwargs(p))
    o, _ = attention_reference(q, k, v, cu, cu, mask=mask)
    return o


def run_point(p: Point, impls: dict, torch, do_bench, rounds: int = 1) -> list[dict]:
    """Check every implementation's output on one set of inputs, then time the ones that passed
    in ``rounds`` interleaved rounds (each impl once per round) and keep the median round: clock
    and thermal drift then hits every impl alike instead of whichever ran last."""
    q, k, v, cu = _inputs(p, torch)
    ref = _reference(p, q, k, v, cu, torch)
    limit = FP8_REL_L2_LIMIT if p.dtype != "bfloat16" else REL_L2_LIMIT
    rows = {}
    for name, fn in ((n, f) for n, f in impls.items() if n not in BACKWARD_ONLY):
        row = dict(point=asdict(p), impl=name)
        rows[name] = row
        try:
            out = fn(q, k, v, p, cu)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row["rel_l2"] = err
            if not err < (FP8_OUT_REL_L2_LIMIT if name in FP8_OUTPUT_IMPLS else limit):
                row["error"] = f"wrong output (rel L2 {err:.3g})"
        except Exception as e:  # a peer may not support a configuration
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    timed = [name for name, row in rows.items() if "error" not in row]
    for _ in range(rounds):
        for name in timed:
            fn = impls[name]
            ms = do_bench(lambda: fn(q, k, v, p, cu), warmup=50, rep=200, return_mode="median")
            rows[name].setdefault("ms_rounds", []).append(ms)
    for name in timed:
        row = rows[name]
        row["ms"] = ms = sorted(row["ms_rounds"])[len(row["ms_rounds"]) // 2]
        row["tflops"] = p.flops() / (ms * 1e-3) / 1e12
        if name == "fmha" and p.dtype == "float8_e4m3fn":
            # the part of each fp8 call spent re-laying V out (included in ms)
            from fmha.kernels.hopper.v_staging import stage_v_fp8

            row["v_staging_ms"] = do_bench(
                lambda: stage_v_fp8(v, cu, max(p.varlen) if p.varlen else p.seqlen),
                warmup=20, rep=100, return_mode="median")
    return list(rows.values())


BACKWARD_IMPLS = ("fmha", "fmha_deterministic", "fa4", "cudnn", "sdpa_flash")
#: implementations that differ from ``fmha`` only in the backward
BACKWARD_ONLY = ("fmha_deterministic",)
BACKWARD_REL_L2_LIMIT = 3e-2  # bf16 gradients against the fp32 reference backward


def run_point_backward(p: Point, impls: dict, torch, do_bench, rounds: int = 1, step: bool = False) -> list[dict]:
    """The backward alone: each implementation's forward once with inputs that require grad,
    then ``torch.autograd.grad`` of its output timed (the same autograd overhead for all), its
    gradients checked against the fp32 reference backward first. TFLOP/s count 2.5x the
    forward's FLOPs (five GEMMs to the forward's two). ``step``: a training step instead, the
    forward and its backward timed together (3.5x the forward's FLOPs); varlen points add
    ``fmha_new_offsets`` (a new offsets tensor every step, no host read)."""
    from fmha.masking import MaskSpec
    from fmha.reference import attention_backward_reference, attention_reference, cast_output

    q, k, v, cu = _inputs(p, torch)
    mask = MaskSpec.from_args(**_mask_kwargs(p))
    out, lse = attention_reference(q, k, v, cu, cu, mask=mask)
    dout = torch.randn(q.shape, device=q.device).to(q.dtype)
    ref = attention_backward_reference(dout, q, k, v, cast_output(out, q.dtype), lse, cu, cu, mask=mask)
    rows, timed = {}, {}
    names = [n for n in BACKWARD_IMPLS if n in impls] + [n for n in impls if n.startswith("fmha_bwd_")]
    if step and p.varlen and "fmha_new_offsets" in impls:
        names.insert(1, "fmha_new_offsets")
    for name in names:
        row = rows[name] = dict(point=asdict(p), impl=name, mode="step" if step else "backward")
        try:
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = impls[name](*leaves, p, cu)
            grads = torch.autograd.grad(o, leaves, dout, retain_graph=True)
            torch.cuda.synchronize()
            err = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, ref))
            row["rel_l2"] = err
            if not err < BACKWARD_REL_L2_LIMIT:
                row["error"] = f"wrong gradients (rel L2 {err:.3g})"
            elif step:
                timed[name] = (lambda fn=impls[name], leaves=leaves:
                               torch.autograd.grad(fn(*leaves, p, cu), leaves, dout))
            else:
                timed[name] = (lambda o=o, leaves=leaves: torch.autograd.grad(o, leaves, dout, retain_graph=True))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    for _ in range(rounds):
        for name, fn in timed.items():
            rows[name].setdefault("ms_rounds", []).append(do_bench(fn, warmup=50, rep=200, return_mode="median"))
    for name in timed:
        row = rows[name]
        row["ms"] = ms = sorted(row["ms_rounds"])[len(row["ms_rounds"]) // 2]
        row["tflops"] = (3.5 if step else 2.5) * p.flops() / (ms * 1e-3) / 1e12
    return list(rows.values())


_FIRST_CALL = r"""
import json, sys, time
import torch
q, k, v = (torch.randn(1, 128, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
torch.cuda.synchronize()
t0 = time.perf_counter()
if sys.argv[1] == "fmha":
    import fmha
    o = fmha.attention(q, k, v, causal=True, backend="kernel")
elif sys.argv[1] == "fmha_decode":  # one decode step over a paged cache (pages of 64, GQA 8:2)
    import fmha
    o = fmha.attention_with_kvcache(q[:, -1:], k.view(2, 64, 8, 128)[:, :, :2].contiguous(),
                                    v.view(2, 64, 8, 128)[:, :, :2].contiguous(),
                                    torch.tensor([128], dtype=torch.int32, device="cuda"),
                                    block_table=torch.tensor([[1, 0]], dtype=torch.int32, device="cuda"),
                                    backend="kernel")
else:
    from flash_attn.cute import flash_attn_func
    o = flash_attn_func(q, k, v, causal=True)
    o = o[0] if isinstance(o, tuple) else o
torch.cuda.synchronize()
elapsed = time.perf_counter() - t0
from fmha.masking import MaskSpec
from fmha.reference import attention_reference
if sys.argv[1] == "fmha_decode":
    kk = torch.cat([k.view(2, 64, 8, 128)[1:, :, :2], k.view(2, 64, 8, 128)[:1, :, :2]], 1).reshape(1, 128, 2, 128)
    vv = torch.cat([v.view(2, 64, 8, 128)[1:, :, :2], v.view(2, 64, 8, 128)[:1, :, :2]], 1).reshape(1, 128, 2, 128)
    ref, _ = attention_reference(q[:, -1:], kk, vv, mask=MaskSpec.from_args(causal=False))
else:
    ref, _ = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True))
err = ((o.float() - ref).norm() / ref.norm()).item()
print(json.dumps({"first_call_s": elapsed, "rel_l2": err}))
"""


SMALL_CALL_ROUNDS = 7


#: (mode, point) of the small-call measurements: host overhead dominates at these sizes
SMALL_CASES = (
    ("forward", Point(1, 128, 8, 8, 128, False, "small")),
    ("forward", Point(1, 0, 8, 8, 128, True, "small", varlen=(100, 1, 27))),
    ("step", Point(1, 128, 8, 8, 128, True, "small")),
    ("step", Point(1, 0, 8, 8, 128, True, "small", varlen=(100, 1, 27))),
)


def _small_call_rows(mode: str, p: Point, impls: dict, torch) -> list[dict]:
    """The cost of one call (``forward``: no autograd; ``step``: the forward and
    ``autograd.grad`` of it) at a point small enough that the host decides it: CUDA events around
    loops of back-to-back calls, the median of ``SMALL_CALL_ROUNDS`` interleaved loops."""
    q, k, v, cu = _inputs(p, torch)
    names = ["fmha", "fmha_new_offsets", "fa4", "cudnn"] if p.varlen else ["fmha", "fa4", "cudnn"]
    calls, rows = {}, []
    for impl in [i for i in names if i in impls]:
        row = dict(kind="small_call", mode=mode, impl=impl, point=asdict(p))
        try:
            if mode == "step":
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                dout = torch.randn(q.shape, device=q.device).to(q.dtype)
                fn = (lambda f=impls[impl], leaves=leaves, dout=dout:
                      torch.autograd.grad(f(*leaves, p, cu), leaves, dout))
            else:
                fn = (lambda f=impls[impl]: f(q, k, v, p, cu))
            fn()  # compiles, or loads from a cache
            torch.cuda.synchronize()
            calls[impl] = (fn, row)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        rows.append(row)
    # Host-bound timings drift with the machine's state: loops of 200 calls, interleaved across
    # the implementations, SMALL_CALL_ROUNDS times; each keeps its median loop.
    for _ in range(SMALL_CALL_ROUNDS):
        for fn, row in calls.values():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 200
            torch.cuda.synchronize()
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize()
            row.setdefault("us_per_loop", []).append(start.elapsed_time(end) * 1e3 / n)
    for _, row in calls.values():
        row["us_per_call"] = sorted(row["us_per_loop"])[len(row["us_per_loop"]) // 2]
    return rows


def measure_startup(impls: dict, torch, small_cases=SMALL_CASES) -> list[dict]:
    """Time to first result (library import + compile or cache load + run, in a fresh process),
    cold and then warm with the same on-disk cache directory; and the per-call cost of the
    ``small_cases`` (``_small_call_rows``)."""
    import subprocess
    import tempfile

    rows = []
    first_calls = [i for i in ("fmha", "fa4") if i in impls]
    if "fmha" in first_calls:  # and a first decode step over a paged cache
        first_calls.insert(1, "fmha_decode")
    for impl in first_calls:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, CUTE_DSL_CACHE_DIR=cache, FMHA_CACHE_DIR=os.path.join(cache, "fmha"))
            for run in ("cold", "warm"):
                res = subprocess.run([sys.executable, "-c", _FIRST_CALL, impl], env=env,
                                     capture_output=True, text=True, timeout=600)
                row = dict(kind="first_call", impl=impl, run=run)
                try:
                    row.update(json.loads(res.stdout.strip().splitlines()[-1]))
                except Exception:
                    row["error"] = (res.stderr or res.stdout).strip().splitlines()[-1:]
                rows.append(row)
    for mode, p in small_cases:
        rows += _small_call_rows(mode, p, impls, torch)
    return rows


def startup_table(rows: list[dict]) -> str:
    lines = ["| measurement | fmha | fa4 | cudnn | fmha / fa4 |", "|---|---|---|---|---|"]
    get = lambda kind, impl, key, run=None: next(
        (r.get(key) for r in rows if r["kind"] == kind and r["impl"] == impl and r.get("run") == run), None)
    for run in ("cold", "warm"):
        a, b = get("first_call", "fmha", "first_call_s", run), get("first_call", "fa4", "first_call_s", run)
        lines.append(f"| first call in a fresh process, {run} cache (s) | {a if a is None else f'{a:.2f}'} | "
                     f"{b if b is None else f'{b:.2f}'} | - | {f'{a / b:.2f}' if a and b else '-'} |")
    for run in ("cold", "warm"):
        a = get("first_call", "fmha_decode", "first_call_s", run)
        if a is not None:
            lines.append(f"| first decode step (paged cache) in a fresh process, {run} cache (s) | {a:.2f} | - | - | - |")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    cases = list(dict.fromkeys((r.get("mode", "forward"), Point(**r["point"]).label()) for r in rows
                               if r["kind"] == "small_call" and "point" in r))
    for mode, label in cases:
        small = {r["impl"]: r["us_per_call"] for r in rows if r["kind"] == "small_call" and "us_per_call" in r
                 and r.get("mode", "forward") == mode and Point(**r["point"]).label() == label}
        what = "forward" if mode == "forward" else "training step (forward + backward)"
        for ours in [i for i in ("fmha", "fmha_new_offsets") if i in small]:
            a, b, c = small[ours], small.get("fa4"), small.get("cudnn")
            extra = ", new offsets each call" if ours == "fmha_new_offsets" else ""
            lines.append(f"| {label}, {what}{extra} (us per call) | {fmt(a)} | {fmt(b)} | {fmt(c)} | "
                         f"{f'{a / b:.2f}' if a and b else '-'} |")
    return "\n".join(lines) + "\n"


def _compile_point(args) -> str:
    """Worker of ``warm_compile_cache``: run the given implementations once at one point (and
    their backward, for ``--backward``/``--step``), so that their kernels land in a disk cache."""
    fields, names, backward = args
    p = Point(**{**fields, "varlen": tuple(fields["varlen"]) if fields["varlen"] else None})
    try:
        import torch

        impls = _implementations(torch, peers=any(n not in LIBRARY_IMPLS for n in names))
        q, k, v, cu = _inputs(p, torch)
    except Exception as e:
        return f"{p.label()}: {type(e).__name__}: {e}"
    failed = []
    for name in (n for n in names if n in impls):
        try:
            leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
            o = impls[name](*leaves, p, cu)
            if backward:
                torch.autograd.grad(o, leaves, torch.randn_like(o))
            torch.cuda.synchronize()
        except Exception as e:  # the timed run reports it; NotImplementedError marks a point not served
            if not isinstance(e, NotImplementedError):
                failed.append(f"{name}: {type(e).__name__}")
    return f"{p.label()}: {', '.join(failed) if failed else 'compiled'}"


def warm_compile_cache(points: list[Point], names: list[str], workers: int, backward: bool) -> None:
    """Compile the kernels of ``points`` in ``workers`` processes before timing: fmha's land in
    its on-disk cache (fmha.jit.disk_cache), FA4's in its own where the environment turns that on
    (``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``), so the timed process loads each in a fraction
    of a second instead of compiling the grid one kernel after another (7-12 s each)."""
    import multiprocessing

    # the variants compile below the library (lab/variants.py), past its disk cache
    cached = [n for n in names if n in LIBRARY_IMPLS
              or (n == "fa4" and os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1")]
    if not cached or not points:
        return
    start = time.perf_counter()
    tasks = [(asdict(p), cached, backward) for p in points]
    with multiprocessing.get_context("spawn").Pool(min(workers, len(tasks))) as pool:
        for line in pool.imap_unordered(_compile_point, tasks):
            if not line.endswith("compiled"):
                print("warm-up:", line, flush=True)
    print(f"compiled {', '.join(cached)} at {len(tasks)} points in {workers} processes: "
          f"{time.perf_counter() - start:.0f} s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="full", choices=["full", "standard", "quick", "extras"])
    ap.add_argument("--out", default=os.path.join("results", "bench"))
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--filter", default="",
                    help="only points whose label contains this ('|' separates alternatives; "
                         "a trailing '$' means the label ends with it)")
    ap.add_argument("--startup", action="store_true",
                    help="only measure time to first result (cold/warm cache) and small-call overhead")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each implementation this many times, interleaved, and keep the median")
    ap.add_argument("--backward", action="store_true",
                    help="time the backward (autograd of each implementation's forward) instead")
    ap.add_argument("--step", action="store_true",
                    help="time a training step (forward + backward) instead; varlen points with new offsets too")
    ap.add_argument("--variants", action="store_true",
                    help="also time the kernel with other compile-time choices (lab/variants.py)")
    ap.add_argument("--compile-workers", type=int, default=0,
                    help="first compile fmha's kernels for the selected points in this many processes "
                         "(into the on-disk cache), so that a full grid fits one device call")
    ap.add_argument("--compile-only", action="store_true",
                    help="with --compile-workers: fill the disk caches and stop (a device call of its own)")
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("lab.bench needs a CUDA GPU (it times kernels against their peers).")
        return 2
    from triton.testing import do_bench
    impls = _implementations(torch, args.variants)
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    if args.startup:
        rows = measure_startup(impls, torch)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "startup.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "rows": rows}, f, indent=1)
        table = startup_table(rows)
        with open(os.path.join(args.out, "startup.md"), "w") as f:
            f.write(f"# Time to first result and small-call overhead, {torch.cuda.get_device_name()}\n\n"
                    f"command: `python -m lab.bench --startup`\n\n" + table)
        print(table)
        return 0
    rows = []
    points = extras_grid() if args.grid == "extras" else build_grid(args.grid)
    def wanted(label: str) -> bool:
        return any(label.endswith(w[:-1]) if w.endswith("$") else w in label
                   for w in args.filter.split("|"))

    if args.backward or args.step:
        points = [p for p in points if p.dtype == "bfloat16" and p.window_left is None]
    points = [p for p in points if wanted(p.label())]
    if args.compile_workers:
        try:
            warm_compile_cache(points, list(impls), args.compile_workers, args.backward or args.step)
        except Exception as e:  # the timed loop compiles what is missing
            print(f"warm-up failed ({type(e).__name__}: {e}); compiling in the timed process", flush=True)
        if args.compile_only:
            return 0
    for p in points:
        if args.backward or args.step:
            new = run_point_backward(p, impls, torch, do_bench, args.rounds, step=args.step)
        else:
            new = run_point(p, impls, torch, do_bench, args.rounds)
        rows += new
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "partial.json"), "w") as f:  # kept if the run is cut off
            json.dump(rows, f)
        got = {r["impl"]: (f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "?")[:40]) for r in new}
        print(p.label(), got, flush=True)
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                command="python -m lab.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__)
    report = "bench_step" if args.step else "bench_backward" if args.backward else "bench"
    print(write_reports(rows, args.out, meta, report))
    if os.path.exists(os.path.join(args.out, "partial.json")):
        os.remove(os.path.join(args.out, "partial.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
