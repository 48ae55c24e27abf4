"""Mixed-batch benchmark on one GPU: chunked prefills and decodes in one call over a paged KV cache,
as vLLM's and SGLang's engines issue them, side by side in one run.

    python -m lab.bench_mixed                        # writes results/bench/mixed/
    python -m lab.bench_mixed --impls fmha,fa4       # a subset

Implementations:
- ``fmha``: ``fmha.attention_varlen(q, k_cache, v_cache, cu_seqlens_q, seqused_k=, block_table=,
  max_seqlen_q=, causal=True)`` (the Hopper forward over the cache, GQA packed, tiles listed on
  the GPU);
- ``fmha_gather``: what fmha ran for such a call before (``fmha.flash_attn.packing``: the used
  K/V rows gathered into a packed batch, then ``fmha.attention_varlen``);
- ``fa4``: FlashAttention-4's ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=,
  seqused_k=, page_table=, max_seqlen_q=, causal=True)``.
Each sequence's keys are its cached keys, its new rows' included (bottom-right causal). Every
output is checked against an fp32 reference (each sequence's keys gathered, SDPA) before it is
timed. Timing: CUDA events through ``triton.testing.do_bench`` (median, eager) and the call
captured in a CUDA graph (``do_bench_cudagraph``). TFLOP/s counts the pairs the mask keeps;
TB/s the K/V bytes the sequences hold. Writes ``mixed.json``, ``mixed.md`` and ``mixed.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass

from lab.timing import bar_plot, not_timed

REL_L2_LIMIT = 2e-2


@dataclass(frozen=True)
class MixedPoint:
    name: str
    rows: tuple  # query rows per sequence
    keys: tuple  # keys per sequence (its rows' own included)
    heads_q: int = 32
    heads_k: int = 8
    head_dim: int = 128
    page_size: int = 64

    def label(self) -> str:
        return f"{self.name} H{self.heads_q}/{self.heads_k} D{self.head_dim} page{self.page_size}"

    def kept_pairs(self) -> int:
        return sum(n * k - n * (n - 1) // 2 if n <= k else k * (k + 1) // 2 for n, k in zip(self.rows, self.keys))

    def flops(self) -> float:
        return 4.0 * self.kept_pairs() * self.heads_q * self.head_dim

    def kv_bytes(self) -> int:
        return 2 * sum(self.keys) * self.heads_k * self.head_dim * 2


def _points() -> list:
    rng = random.Random(0)

    def decodes(n, lo, hi):
        return [1] * n, [rng.randint(lo, hi) for _ in range(n)]

    points = []
    # 4 chunked prefills of 512-2048 rows (their earlier chunks cached) + 60 decodes, S_k 1k-32k
    d_rows, d_keys = decodes(60, 1024, 32768)
    p_rows = [512, 1024, 1536, 2048]
    p_keys = [r + rng.randint(0, 8192) for r in p_rows]
    for hq, hk, ps in ((32, 8, 64), (32, 8, 16), (64, 8, 64)):
        points.append(MixedPoint("4 prefills + 60 decodes", tuple(p_rows + d_rows), tuple(p_keys + d_keys), hq, hk,
                                 page_size=ps))
    d_rows, d_keys = decodes(64, 1024, 32768)
    points.append(MixedPoint("64 decodes", tuple(d_rows), tuple(d_keys)))
    d_rows, d_keys = decodes(8, 4096, 16384)
    points.append(MixedPoint("8 decodes", tuple(d_rows), tuple(d_keys)))
    d_rows, d_keys = decodes(24, 1024, 8192)
    points.append(MixedPoint("8 prefills of 1k + 24 decodes", tuple([1024] * 8 + d_rows),
                             tuple([rng.randint(1024, 8192) for _ in range(8)] + d_keys)))
    return points


def _inputs(point: MixedPoint, torch):
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    total = sum(point.rows)
    q = torch.randn(total, point.heads_q, point.head_dim, generator=g, device=dev).to(dt)
    cu = torch.tensor([0] + list(torch.tensor(point.rows).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    pages = [-(-k // point.page_size) for k in point.keys]
    num_pages = sum(pages)
    k_cache = torch.randn(num_pages, point.page_size, point.heads_k, point.head_dim, generator=g, device=dev).to(dt)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_pages, device=dev).to(torch.int32)  # pages in any order
    table = torch.zeros(len(point.rows), max(pages), dtype=torch.int32, device=dev)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    seqused = torch.tensor(point.keys, dtype=torch.int32, device=dev)
    return q, k_cache, v_cache, cu, seqused, table


def _reference(point, q, k_cache, v_cache, cu, table, torch):
    import torch.nn.functional as F

    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    g = point.heads_q // point.heads_k
    for b, (n, keys) in enumerate(zip(point.rows, point.keys)):
        pos = torch.arange(keys, device=q.device)
        pages = table[b, pos // point.page_size].long()
        k = k_cache[pages, pos % point.page_size].float().repeat_interleave(g, dim=1).transpose(0, 1)
        v = v_cache[pages, pos % point.page_size].float().repeat_interleave(g, dim=1).transpose(0, 1)
        rows = slice(int(cu[b]), int(cu[b + 1]))
        keep = pos[None, :] <= torch.arange(n, device=q.device)[:, None] + keys - n
        out[rows] = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1), k, v,
                                                   attn_mask=keep).transpose(0, 1)
    return out


def _implementations() -> dict:
    import torch

    import fmha

    def ours(point, q, k, v, cu, seqused, table):
        out = torch.empty_like(q)
        return lambda: fmha.attention_varlen(q, k, v, cu, seqused_k=seqused, block_table=table,
                                             max_seqlen_q=max(point.rows), causal=True, out=out, backend="kernel")

    def gathered(point, q, k, v, cu, seqused, table):
        from fmha.flash_attn import packing

        return lambda: packing.attend_gathered(
            q, k, v, cu_seqlens_q=cu, cu_seqlens_k=None, seqused_q=None, seqused_k=seqused, page_table=table,
            batch=len(point.rows), want_lse=False, mask_align="bottom_right", deterministic=False,
            window_size=(None, 0), softmax_scale=None, softcap=0.0, sinks=None)[0]

    impls = {"fmha": ours, "fmha_gather": gathered}
    try:
        from flash_attn.cute import flash_attn_varlen_func

        def fa4(point, q, k, v, cu, seqused, table):
            def call():
                out = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, seqused_k=seqused, page_table=table,
                                             max_seqlen_q=max(point.rows), causal=True)
                return out[0] if isinstance(out, tuple) else out
            return call

        impls["fa4"] = fa4
    except Exception as e:
        print(f"FlashAttention-4 not available: {e}", file=sys.stderr)
    return impls


def run_point(point: MixedPoint, impls: dict, torch, rounds: int) -> list:
    from triton.testing import do_bench, do_bench_cudagraph

    q, k, v, cu, seqused, table = _inputs(point, torch)
    want = _reference(point, q, k, v, cu, table, torch)
    rows = []
    for name, setup in impls.items():
        row = dict(point=asdict(point), label=point.label(), impl=name)
        try:
            call = setup(point, q, k, v, cu, seqused, table)
            out = call()
            torch.cuda.synchronize()
            err = ((out.float() - want).norm() / want.norm()).item()
            row["rel_l2"] = err
            if not err < REL_L2_LIMIT:
                row["error"] = f"wrong answer (rel L2 {err:.3g})"
            else:
                eager = [do_bench(call, warmup=25, rep=100, return_mode="median") for _ in range(rounds)]
                row["eager_us"] = 1e3 * statistics.median(eager)
                if name != "fmha_gather":  # it reads the lengths on the host: not capturable
                    graph = [do_bench_cudagraph(call, rep=100, return_mode="median") for _ in range(rounds)]
                    row["graph_us"] = 1e3 * statistics.median(graph)
                best = row.get("graph_us", row["eager_us"])
                row["tflops"] = point.flops() / (best * 1e-6) / 1e12
                row["tb_s"] = point.kv_bytes() / (best * 1e-6) / 1e12
        except Exception as e:  # a peer that cannot run a point records why
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
        print(json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "point"}), flush=True)
    del q, k, v, want
    torch.cuda.empty_cache()
    return rows


def write_reports(rows: list, out_dir: str, meta: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "mixed.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    by = {(r["label"], r["impl"]): r for r in rows}
    lines = [f"# Mixed batches, {meta.get('device', '')}: microseconds per call in a CUDA graph (eager in "
             "brackets; fmha_gather eager only)", "",
             "| point | " + " | ".join(impls) + " | fmha TFLOP/s | fmha TB/s | fmha / FA4 |",
             "|---" * (len(impls) + 4) + "|"]
    ratios = []
    for label in labels:
        cells = []
        for impl in impls:
            r = by.get((label, impl), {})
            if "graph_us" in r:
                cells.append(f"{r['graph_us']:.0f} ({r['eager_us']:.0f})")
            else:
                cells.append(f"({r['eager_us']:.0f})" if "eager_us" in r else "-")
        ours, fa4 = by.get((label, "fmha"), {}), by.get((label, "fa4"), {})
        ratio = ""
        if "graph_us" in ours and "graph_us" in fa4:
            ratios.append(fa4["graph_us"] / ours["graph_us"])
            ratio = f"{ratios[-1]:.2f}x"
        tf = f"{ours['tflops']:.0f}" if "tflops" in ours else "-"
        tb = f"{ours['tb_s']:.2f}" if "tb_s" in ours else "-"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {tf} | {tb} | {ratio} |")
    if ratios:
        lines += ["", f"fmha speed / FA4's (graph times): median {statistics.median(ratios):.2f}x, "
                      f"min {min(ratios):.2f}x"]
    lines += not_timed(rows)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "mixed.md"), "w") as f:
        f.write(text)

    def height(label, impl):
        row = by.get((label, impl), {})
        return row.get("graph_us", row.get("eager_us", 0))
    bar_plot(os.path.join(out_dir, "mixed.png"), labels, impls, height,
             "us per call (CUDA graph; gather: eager), lower is better", rotation=20, log=True)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("results", "bench", "mixed"))
    ap.add_argument("--impls", default="", help="comma-separated subset of implementations")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    import torch

    impls = _implementations()
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    rows = []
    for point in _points():
        rows += run_point(point, impls, torch, args.rounds)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, impls=list(impls),
                command="python -m lab.bench_mixed " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(write_reports(rows, args.out, meta))


if __name__ == "__main__":
    main()
