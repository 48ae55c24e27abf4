"""Decode benchmark on one GPU: ``fmha.attention_with_kvcache`` (dense and paged caches) against
the peers importable there, side by side in one run.

    python -m lab.bench_decode                       # writes results/bench/decode/
    python -m lab.bench_decode --impls fmha,fa4      # a subset

Peers: FlashAttention-4 (``flash_attn.cute.flash_attn_func`` on the dense cache, causal: its
masks align bottom-right), FlashAttention-3 (``fa3_fwd_interface``, where it is importable),
PyTorch SDPA's flash backend (FA2; S_q = 1 only, where no mask is the bottom-right causal
mask). Every cache is full (each sequence holds S_k keys), so all read the same bytes, but for
the ``fmha_fp8`` rows: the same cache quantized to e4m3 (one scale per tensor), half the bytes.
Every output is checked against an fp32 reference first (a wrong answer is reported, not timed;
the fp8 rows against the bf16 cache's, with a bound that allows for the quantization).
Timing: CUDA events through ``triton.testing.do_bench`` (median) on eager calls, and the same
call captured in a CUDA graph (``do_bench_cudagraph``), as servers replay decode steps.
Bandwidth = bytes of K and V read / time. Writes ``decode.json``, ``decode.md`` and
``decode.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from dataclasses import asdict, dataclass

from lab.timing import bar_plot, not_timed

REL_L2_LIMIT = 2e-2
#: fp8-cache rows are checked against the bf16 cache they were quantized from (e4m3 keeps 3
#: mantissa bits)
REL_L2_LIMIT_FP8 = 6e-2
E4M3_MAX = 448.0


@dataclass(frozen=True)
class DecodePoint:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_k: int
    head_dim: int = 128

    def label(self) -> str:
        return f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k} H{self.heads_q}/{self.heads_k} D{self.head_dim}"

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seqlen_k * self.heads_k * self.head_dim * 2


POINTS = [
    DecodePoint(16, 1, 8192, 32, 8),
    DecodePoint(64, 1, 4096, 32, 8),
    DecodePoint(16, 4, 8192, 32, 8),
    DecodePoint(8, 16, 16384, 64, 8),
    DecodePoint(1, 1, 131072, 32, 8),
    DecodePoint(128, 1, 1024, 32, 8),
    DecodePoint(32, 1, 8192, 32, 32),
    DecodePoint(4, 1, 32768, 32, 4),
    DecodePoint(2, 2, 65536, 64, 8),
]


def _implementations(torch, page_sizes) -> dict:
    """name -> setup(point, q, k, v) returning a zero-argument call."""
    import fmha

    def ours(point, q, k, v):
        lengths = torch.full((point.batch,), point.seqlen_k, dtype=torch.int32, device=q.device)
        out = torch.empty_like(q)
        return lambda: fmha.attention_with_kvcache(q, k, v, lengths, out=out, backend="kernel")

    def ours_paged(page_size):
        def setup(point, q, k, v):
            per_seq = point.seqlen_k // page_size
            order = torch.randperm(point.batch * per_seq, device=q.device)  # pages in any order
            kp = torch.empty((point.batch * per_seq, page_size) + k.shape[2:], dtype=k.dtype, device=k.device)
            vp = torch.empty_like(kp)
            kp[order] = k.reshape(-1, page_size, *k.shape[2:])
            vp[order] = v.reshape(-1, page_size, *v.shape[2:])
            table = order.view(point.batch, per_seq).to(torch.int32)
            lengths = torch.full((point.batch,), point.seqlen_k, dtype=torch.int32, device=q.device)
            out = torch.empty_like(q)
            return lambda: fmha.attention_with_kvcache(q, kp, vp, lengths, block_table=table, out=out,
                                                       backend="kernel")
        return setup

    def ours_dense_api(point, q, k, v):
        """fmha.attention on the full cache (bottom-right causal): dense calls with few query
        rows take the same decode configuration."""
        out = torch.empty_like(q)
        return lambda: fmha.attention(q, k, v, causal=True, mask_align="bottom_right", out=out, backend="kernel")

    def quantized(t):
        """t in e4m3 with one per-tensor dequantization factor (values = stored x scale)."""
        scale = max(t.abs().max().item(), 1e-30) / E4M3_MAX
        return (t.float() / scale).to(torch.float8_e4m3fn), scale

    def ours_fp8(page_size):
        """fmha over an fp8 (e4m3) copy of the cache: the same call, half the bytes."""
        def setup(point, q, k, v):
            (k8, scale_k), (v8, scale_v) = quantized(k), quantized(v)
            lengths = torch.full((point.batch,), point.seqlen_k, dtype=torch.int32, device=q.device)
            table = None
            if page_size:
                per_seq = point.seqlen_k // page_size
                order = torch.randperm(point.batch * per_seq, device=q.device)
                kp = torch.empty((point.batch * per_seq, page_size) + k.shape[2:], dtype=k8.dtype, device=k.device)
                vp = torch.empty_like(kp)
                kp[order] = k8.reshape(-1, page_size, *k.shape[2:])
                vp[order] = v8.reshape(-1, page_size, *v.shape[2:])
                k8, v8, table = kp, vp, order.view(point.batch, per_seq).to(torch.int32)
            out = torch.empty_like(q)
            return lambda: fmha.attention_with_kvcache(q, k8, v8, lengths, block_table=table, out=out,
                                                       scale_k=scale_k, scale_v=scale_v, backend="kernel")
        return setup

    impls = {"fmha": ours, "fmha_attention": ours_dense_api}
    for ps in page_sizes:
        impls[f"fmha_paged{ps}"] = ours_paged(ps)
    impls["fmha_fp8"] = ours_fp8(0)
    for ps in page_sizes:
        impls[f"fmha_fp8_paged{ps}"] = ours_fp8(ps)
    try:
        from flash_attn.cute import flash_attn_func

        def fa4(point, q, k, v):
            def call():
                out = flash_attn_func(q, k, v, causal=True)
                return out[0] if isinstance(out, tuple) else out
            return call

        impls["fa4"] = fa4
    except Exception as e:
        print(f"FlashAttention-4 not available: {e}", file=sys.stderr)
    try:
        import fa3_fwd_interface as fa3

        def fa3_decode(point, q, k, v):
            def call():
                out = fa3.flash_attn_func(q, k, v, causal=True)
                return out[0] if isinstance(out, tuple) else out
            return call

        impls["fa3"] = fa3_decode
    except ImportError:
        pass
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    def sdpa_flash(point, q, k, v):
        if point.seqlen_q != 1:
            raise NotImplementedError("SDPA's causal mask is top-left; bottom-right needs S_q = 1 (no mask)")
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def call():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
        return call

    impls["sdpa_flash"] = sdpa_flash
    return impls


def _reference(point, q, k, v, torch):
    """fp32 attention of the query rows over the full cache, bottom-right causal."""
    import torch.nn.functional as F

    g = point.heads_q // point.heads_k
    qt = q.float().transpose(1, 2)
    kt = k.float().repeat_interleave(g, dim=2).transpose(1, 2)
    vt = v.float().repeat_interleave(g, dim=2).transpose(1, 2)
    rows = torch.arange(point.seqlen_q, device=q.device)[:, None] + point.seqlen_k - point.seqlen_q
    keep = torch.arange(point.seqlen_k, device=q.device)[None, :] <= rows
    return F.scaled_dot_product_attention(qt, kt, vt, attn_mask=keep).transpose(1, 2)


def run_point(point: DecodePoint, impls: dict, torch, rounds: int) -> list:
    from triton.testing import do_bench, do_bench_cudagraph

    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (point.batch, point.seqlen_q, point.heads_q, point.head_dim)
    shape_k = (point.batch, point.seqlen_k, point.heads_k, point.head_dim)
    q = torch.randn(shape_q, generator=g, device="cuda").to(torch.bfloat16)
    k = torch.randn(shape_k, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(shape_k, generator=g, device="cuda").to(torch.bfloat16)
    want = _reference(point, q, k, v, torch)
    rows = []
    for name, setup in impls.items():
        row = dict(point=asdict(point), label=point.label(), impl=name)
        try:
            call = setup(point, q, k, v)
            out = call()
            torch.cuda.synchronize()
            err = ((out.float() - want).norm() / want.norm()).item()
            row["rel_l2"] = err
            if not err < (REL_L2_LIMIT_FP8 if "fp8" in name else REL_L2_LIMIT):
                row["error"] = f"wrong answer (rel L2 {err:.3g})"
            else:
                eager = [do_bench(call, warmup=25, rep=100, return_mode="median") for _ in range(rounds)]
                graph = [do_bench_cudagraph(call, rep=100, return_mode="median") for _ in range(rounds)]
                row["eager_us"] = 1e3 * statistics.median(eager)
                row["graph_us"] = 1e3 * statistics.median(graph)
                kv_bytes = point.kv_bytes() // (2 if "fp8" in name else 1)
                row["graph_tb_s"] = kv_bytes / (row["graph_us"] * 1e-6) / 1e12
        except Exception as e:  # a peer that cannot run a point records why
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "point"}), flush=True)
    del q, k, v, want
    torch.cuda.empty_cache()
    return rows


def _compile_one(cfg):
    from fmha.jit import disk_cache
    from fmha.kernels.hopper.forward_runner import compile_forward

    disk_cache.load_or_compile(cfg, compile_forward)


def precompile(points, page_sizes, torch, workers: int) -> int:
    """Compile every kernel the fmha rows will use, in parallel processes, into the disk cache
    (so that no timed point waits for a compile). Returns how many there are."""
    import multiprocessing as mp

    from fmha.jit.launch import sm_count
    from fmha.kernels.hopper.decode_runner import HopperDecodeRunner
    from fmha.kvcache import decode_problem

    configs = set()
    for p in points:
        q = torch.empty(p.batch, p.seqlen_q, p.heads_q, p.head_dim, dtype=torch.bfloat16, device="meta")
        lengths = torch.empty(p.batch, dtype=torch.int32, device="meta")
        caches = [(torch.empty(p.batch, p.seqlen_k, p.heads_k, p.head_dim, dtype=torch.bfloat16, device="meta"),
                   None)]
        for ps in page_sizes:
            per_seq = p.seqlen_k // ps
            caches.append((torch.empty(p.batch * per_seq, ps, p.heads_k, p.head_dim, dtype=torch.bfloat16,
                                       device="meta"), torch.empty(p.batch, per_seq, dtype=torch.int32, device="meta")))
        for (k, table), cache_dtype in itertools.product(caches, (torch.bfloat16, torch.float8_e4m3fn)):
            k = torch.empty(k.shape, dtype=cache_dtype, device="meta")
            problem, _ = decode_problem(q, k, k, lengths, block_table=table)
            problem = problem.__class__(**{**problem.__dict__, "device": torch.device("cuda")})
            configs.add(HopperDecodeRunner(problem).plan(problem, sm_count(torch.device("cuda"))).cfg)
    with mp.get_context("spawn").Pool(workers) as pool:
        pool.map(_compile_one, sorted(configs, key=repr))
    return len(configs)


def write_reports(rows: list, out_dir: str, meta: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["impl"]): r for r in rows}
    peers = [i for i in impls if i in ("fa3", "fa4")]
    lines = [f"# Decode, {meta.get('device', '')}: microseconds per call in a CUDA graph (eager in brackets)", "",
             "| point | " + " | ".join(impls) + " | fmha TB/s | fmha / best of FA3, FA4 | fp8 cache: TB/s, "
             "speed / bf16 |",
             "|---" * (len(impls) + 4) + "|"]
    ratios, fp8_speedups = [], []
    for label in labels:
        cells = []
        for impl in impls:
            r = by.get((label, impl), {})
            cells.append(f"{r['graph_us']:.0f} ({r['eager_us']:.0f})" if "graph_us" in r else "-")
        ours = by.get((label, "fmha"), {})
        best = [by[(label, p)]["graph_us"] for p in peers if "graph_us" in by.get((label, p), {})]
        ratio = ""
        if best and "graph_us" in ours:
            ratio_v = min(best) / ours["graph_us"]
            ratios.append(ratio_v)
            ratio = f"{ratio_v:.2f}x"
        tbs = f"{ours['graph_tb_s']:.2f}" if "graph_tb_s" in ours else "-"
        fp8 = by.get((label, "fmha_fp8"), {})
        fp8_cell = "-"
        if "graph_us" in fp8 and "graph_us" in ours:
            fp8_speedups.append(ours["graph_us"] / fp8["graph_us"])
            fp8_cell = f"{fp8['graph_tb_s']:.2f}, {fp8_speedups[-1]:.2f}x"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {tbs} | {ratio} | {fp8_cell} |")
    if ratios:
        lines += ["", f"Median fmha speed / the faster of FA3 and FA4 (graph times): {statistics.median(ratios):.2f}x"]
    if fp8_speedups:
        lines += [f"Median speed of the fp8 cache / the bf16 cache (dense, graph times): "
                  f"{statistics.median(fp8_speedups):.2f}x"]
    lines += not_timed(rows)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "decode.md"), "w") as f:
        f.write(text)
    bar_plot(os.path.join(out_dir, "decode.png"), labels, impls,
             lambda label, impl: by.get((label, impl), {}).get("graph_us", 0),
             "us per call (CUDA graph), lower is better")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("results", "bench", "decode"))
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--page_sizes", default="16,256")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    impls = _implementations(torch, [int(x) for x in args.page_sizes.split(",") if x])
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    if any(name.startswith("fmha") for name in impls):
        count = precompile(POINTS, [int(x) for x in args.page_sizes.split(",") if x], torch,
                           max(1, (os.cpu_count() or 2) - 1))
        print(f"{count} fmha kernels compiled", flush=True)
    rows = []
    for point in POINTS:
        rows += run_point(point, impls, torch, args.rounds)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, impls=list(impls))
    print(write_reports(rows, args.out, meta))


if __name__ == "__main__":
    main()
