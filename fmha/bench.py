"""Side-by-side forward-attention benchmark on one GPU: fmha against the peers importable there.

    python -m fmha.bench                       # the standard grid + extras, writes results/bench/
    python -m fmha.bench --grid quick          # a handful of points

Peers: FlashAttention-4 (``flash_attn.cute.flash_attn_func``), PyTorch SDPA with the cuDNN and the
flash backends. Every implementation's output is checked against the fp32 reference on the same
inputs before it is timed (a wrong answer is reported, not timed). Timing: CUDA events through
``triton.testing.do_bench`` (median), after a warm-up call that compiles. TFLOP/s =
4 * B * H_q * S_q * S_k * D / time, halved for causal with S_q == S_k (the usual convention).
Writes ``bench.json``, ``bench.md`` and ``bench.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

REL_L2_LIMIT = 2e-2  # bf16 outputs against the fp32 reference


@dataclass(frozen=True)
class Point:
    batch: int
    seqlen: int
    heads_q: int
    heads_k: int
    head_dim: int
    causal: bool
    group: str = "standard"

    def flops(self) -> float:
        f = 4.0 * self.batch * self.heads_q * self.seqlen * self.seqlen * self.head_dim
        return f / 2 if self.causal else f

    def label(self) -> str:
        return (f"B{self.batch} S{self.seqlen} H{self.heads_q}/{self.heads_k} D{self.head_dim}"
                f"{' causal' if self.causal else ''}")


def build_grid(name: str) -> list[Point]:
    seqlens = [512, 1024, 2048, 4096, 8192, 16384]
    if name == "quick":
        return [Point(16384 // s, s, 2048 // d, 2048 // d, d, c)
                for d in (64, 128) for s in (1024, 8192) for c in (False, True)]
    pts = [Point(16384 // s, s, 2048 // d, 2048 // d, d, c)
           for d in (64, 128) for c in (False, True) for s in seqlens]
    pts += [Point(16384 // s, s, 16, 2, 128, c, "gqa8") for s in (2048, 8192) for c in (False, True)]
    return pts


def _kernel_variant(**overrides) -> Callable:
    """fmha's Hopper kernel with some compile-time choices overridden (mainloop, scheduling,
    tile), called below the public API: to measure what each technique buys."""
    import dataclasses

    from fmha.kernels.hopper.backend import HopperConfig, HopperRunner, compile_kernel
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    runners = {}

    def fn(q, k, v, causal):
        problem = validate(q, k, v, causal=causal)
        cfg = dataclasses.replace(HopperConfig.from_problem(problem, KernelOptions()), **overrides)
        if cfg not in runners:
            runners[cfg] = HopperRunner(cfg, compile_kernel(cfg))
        out = q.new_empty(q.shape)
        runners[cfg](problem, q, k, v, out, None)
        return out

    return fn


# name -> compile-time overrides of the default kernel, timed with --variants
VARIANTS = {
    "fmha_serial": dict(overlap=False, pingpong=False),
    "fmha_nopingpong": dict(pingpong=False),
    "fmha_nonpersistent": dict(persistent=False),
    "fmha_tile128": dict(tile_m=128),
}


def _implementations(torch, variants: bool = False) -> dict[str, Callable]:
    """name -> fn(q, k, v, causal) on BSHD tensors, for the peers importable here."""
    import fmha

    impls: dict[str, Callable] = {
        "fmha": lambda q, k, v, causal: fmha.attention(q, k, v, causal=causal, backend="kernel"),
    }
    if variants:
        for name, overrides in VARIANTS.items():
            impls[name] = _kernel_variant(**overrides)
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(q, k, v, causal):
            out = flash_attn_func(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        impls["fa4"] = fa4
    except Exception as e:  # not importable on this machine
        print(f"FlashAttention-4 not available: {e}", file=sys.stderr)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def sdpa(backend):
        def fn(q, k, v, causal):
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    qt, kt, vt, is_causal=causal, enable_gqa=qt.shape[1] != kt.shape[1]
                ).transpose(1, 2)
        return fn

    impls["cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
    impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    return impls


def _reference(q, k, v, causal, torch):
    from fmha.masking import MaskSpec
    from fmha.reference import attention_reference

    o, _ = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=causal))
    return o


def run_point(p: Point, impls: dict, torch, do_bench) -> list[dict]:
    dev = torch.device("cuda")
    q = torch.randn(p.batch, p.seqlen, p.heads_q, p.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(p.batch, p.seqlen, p.heads_k, p.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(p.batch, p.seqlen, p.heads_k, p.head_dim, device=dev, dtype=torch.bfloat16)
    ref = _reference(q, k, v, p.causal, torch)
    rows = []
    for name, fn in impls.items():
        row = dict(point=asdict(p), impl=name)
        try:
            out = fn(q, k, v, p.causal)
            torch.cuda.synchronize()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            row["rel_l2"] = err
            if not err < REL_L2_LIMIT:
                row["error"] = f"wrong output (rel L2 {err:.3g})"
            else:
                ms = do_bench(lambda: fn(q, k, v, p.causal), warmup=50, rep=200, return_mode="median")
                row["ms"] = ms
                row["tflops"] = p.flops() / (ms * 1e-3) / 1e12
        except Exception as e:  # a peer may not support a configuration
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(row)
    return rows


def write_reports(rows: list[dict], out_dir: str, meta: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    points = list(dict.fromkeys(json.dumps(r["point"], sort_keys=True) for r in rows))
    by = {(json.dumps(r["point"], sort_keys=True), r["impl"]): r for r in rows}
    head = "| point | " + " | ".join(f"{i} TFLOP/s" for i in impls)
    if "fa4" in impls:
        head += " | fmha / fa4"
    if "cudnn" in impls:
        head += " | fmha / cudnn"
    lines = [f"# Forward attention, bf16, {meta['device']}", "",
             f"{meta['date']}; command: `{meta['command']}`", "", head + " |",
             "|" + "---|" * (head.count("|"))]
    ratios = {"fa4": [], "cudnn": []}
    for pk in points:
        p = Point(**json.loads(pk))
        cells = []
        for i in impls:
            r = by.get((pk, i), {})
            cells.append(f"{r['tflops']:.0f}" if "tflops" in r else ("n/a" if not r else "err"))
        for peer in ("fa4", "cudnn"):
            if peer in impls:
                a, b = by.get((pk, "fmha"), {}), by.get((pk, peer), {})
                if "tflops" in a and "tflops" in b:
                    ratios[peer].append(a["tflops"] / b["tflops"])
                    cells.append(f"{a['tflops'] / b['tflops']:.2f}")
                else:
                    cells.append("-")
        lines.append(f"| {p.label()} | " + " | ".join(cells) + " |")
    summary = []
    for peer, rs in ratios.items():
        if rs:
            summary.append(f"fmha/{peer}: median {statistics.median(rs):.2f}, min {min(rs):.2f} over {len(rs)} points")
    lines += ["", *summary]
    errs = [f"- {r['impl']} {Point(**r['point']).label()}: {r['error']}" for r in rows if "error" in r]
    if errs:
        lines += ["", "Errors:", *errs]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(text)
    _plot(rows, impls, os.path.join(out_dir, "bench.png"), meta)
    return text


def _plot(rows, impls, path, meta):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return
    panels = sorted({(r["point"]["head_dim"], r["point"]["causal"]) for r in rows
                     if r["point"]["group"] == "standard"})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (d, c) in zip(axes[0], panels):
        for impl in impls:
            pts = sorted((r["point"]["seqlen"], r["tflops"]) for r in rows
                         if r["impl"] == impl and "tflops" in r and r["point"]["group"] == "standard"
                         and r["point"]["head_dim"] == d and r["point"]["causal"] == c)
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"D={d} {'causal' if c else 'non-causal'}")
        ax.set_xlabel("sequence length (B*S = 16384)")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"bf16 forward attention, {meta['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", default="full", choices=["full", "quick"])
    ap.add_argument("--out", default=os.path.join("results", "bench"))
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--variants", action="store_true",
                    help="also time fmha's other mainloop variants (serial, overlap without ping-pong)")
    args = ap.parse_args(argv)

    import torch
    from triton.testing import do_bench

    if not torch.cuda.is_available():
        print("fmha.bench needs a CUDA GPU (it times kernels against their peers).")
        return 2
    impls = _implementations(torch, args.variants)
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    rows = []
    for p in build_grid(args.grid):
        rows += run_point(p, impls, torch, do_bench)
        got = {r["impl"]: (f"{r['tflops']:.0f}" if "tflops" in r else r.get("error", "?")[:40]) for r in rows[-len(impls):]}
        print(p.label(), got, flush=True)
    meta = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d %H:%M"),
                command="python -m fmha.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                torch=torch.__version__)
    print(write_reports(rows, args.out, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
