"""NSA's selection branch against its peers, side by side in one process (docs/nsa.md).

Given the same selection lists (per token and KV head: the current block, the previous one and
block 0, then random earlier blocks up to ``--count``, ascending, -1 padded), one packed sequence
of T tokens, bf16, D=128:

* ``fmha``: ``fmha.nsa.selection_attention(..., backend="kernel")``: the forward on the selection
  kernel (each query tile of a few tokens' GQA heads walks their own blocks), the backward on the
  selection backward kernel (each K/V tile of a sequence walks the query tiles that chose it);
* ``fmha_bwd_block_mask``: fwd+bwd only: ``fmha``'s forward, then the backward on fmha's backward
  kernel with the lists as a block mask (the form before the selection backward kernel);
* ``fmha_block_mask``: the forward with the lists as a block mask on fmha's attention kernel (the
  form before the selection kernel; only up to ``--torch-max``);
* ``fmha_torch``: the PyTorch gather path (``backend="reference"``; only up to ``--torch-max``);
* ``fla``: flash-linear-attention's ``parallel_nsa`` selection (Triton; needs G = H_q/H_k a power
  of two >= 16), with ``block_indices`` and ``block_counts``;
* ``fmha_causal`` / ``fa4_causal``: dense causal attention over the same tokens (the bar NSA must
  clear).

FLOPs count the (row, key) pairs each query keeps (its listed keys up to itself, the causal ones
for the dense rows): fwd 4*H_q*D*kept, fwd+bwd 3.5x. A row: ms (median, lab/timing), TFLOP/s,
``speedup_vs_fmha_causal``, ``err`` (relative L2 error of the output against ``fmha_torch`` in
fp32 on the first 2048 tokens), or ``error`` / ``skipped``.

fla (the ``fla-core`` package) and FlashAttention-4 must be importable, e.g. installed from their
wheels: ``python3 -m pip install --no-deps --target /tmp/site fla_core-0.6.0-py3-none-any.whl``
and ``export PYTHONPATH=/tmp/site:$PYTHONPATH``.

    python lab/bench_nsa.py --backward --out results/bench/nsa/nsa.json
    python lab/bench_nsa.py --backward --profile --impls fmha  # where fmha's time goes, per kernel
    python lab/bench_nsa.py --topk --impls fmha,fmha_nosync,fmha_graph,fla  # the top-k alone (direction "topk")

``--topk`` times the top-k selection instead, at fla's geometry (l = d = l' = 64, mean pooling, the
compression LSE from fmha's kernel, not timed): ``fmha`` = ``fmha.nsa.select_blocks(..., backend="kernel")``
(the fused top-k kernel), ``fmha_nosync`` = the same with ``max_seqlen`` (offsets checked on the
device, no host read), ``fmha_graph`` = its op replayed from a CUDA graph (the GPU time without
checks and launches), ``fmha_torch`` = its PyTorch path (``backend="reference"``, up to
``--torch-max``), ``fla`` = ``fla.ops.nsa.parallel.parallel_nsa_topk`` (Triton); ``same_lists`` is
the fraction of (token, KV head) lists on which an impl agrees with ``fmha`` (fla's scores are
bf16, ours fp32, in another order on the PyTorch path, so near-ties may differ).
"""

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fmha  # noqa: E402
import fmha.nsa as nsa  # noqa: E402
from fmha.nsa.selection import selection_backward_block_mask, selection_forward_block_mask  # noqa: E402
from lab.profile_step import profile_point  # noqa: E402
from lab.timing import keep_row, seconds_per_call  # noqa: E402

BLOCK = 64


def selection_lists(total: int, heads_k: int, count: int, gen, device="cuda") -> torch.Tensor:
    """(T, H_k, count) int32: the forced blocks (current, previous, 0) then random earlier ones,
    ascending, -1 padded; what the top-k returns, with random scores."""
    t = torch.arange(total, device=device)
    current = (t // BLOCK).view(total, 1, 1).expand(total, heads_k, 1)
    keys = torch.rand(total, heads_k, (total + BLOCK - 1) // BLOCK, generator=gen, device=device)
    blocks = torch.arange(keys.shape[-1], device=device).view(1, 1, -1)
    keys = torch.where(blocks > current, -1.0, keys)  # no future block
    keys = torch.where((blocks == current) | (blocks == current - 1) | (blocks == 0), 2.0, keys)
    top = keys.topk(min(count, keys.shape[-1]), dim=-1)
    sel = torch.where(top.values >= 0, top.indices, torch.full_like(top.indices, 1 << 30))
    sel = sel.sort(dim=-1).values
    return torch.where(sel == 1 << 30, -1, sel).to(torch.int32)


def kept_pairs(sel: torch.Tensor) -> int:
    t = torch.arange(sel.shape[0], device=sel.device).view(-1, 1, 1)
    first = sel.long() * BLOCK
    kept = torch.clamp(torch.minimum(first + BLOCK - 1, t) - first + 1, min=0)
    return int(torch.where(sel >= 0, kept, 0).sum(-1).float().mean(-1).sum())  # per KV group, averaged


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,16384,32768,65536")
    ap.add_argument("--heads", default="64/4,32/8", help="H_q/H_k pairs")
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--impls", default="fmha,fmha_bwd_block_mask,fmha_block_mask,fmha_torch,fla,fmha_causal,fa4_causal")
    ap.add_argument("--torch-max", type=int, default=8192, help="longest T the PyTorch gather path runs")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--topk", action="store_true", help="time the top-k selection instead (module doc)")
    ap.add_argument("--rep", type=int, default=200)
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop starting new points after this")
    ap.add_argument("--profile", action="store_true",
                    help="add fmha's per-kernel times (lab.profile_step's table) to its rows")
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.load(open(args.table))["rows"]))
        return
    impls = args.impls.split(",")
    start, rows = time.time(), []
    d, dtype = 128, torch.bfloat16
    for total in (int(x) for x in args.tokens.split(",")):
        for hq, hk in (tuple(int(x) for x in p.split("/")) for p in args.heads.split(",")):
            gen = torch.Generator(device="cuda").manual_seed(total + hq)
            q = torch.randn(total, hq, d, generator=gen, device="cuda", dtype=dtype)
            k, v = (torch.randn(total, hk, d, generator=gen, device="cuda", dtype=dtype) for _ in range(2))
            cu = torch.tensor([0, total], dtype=torch.int32, device="cuda")
            sel = selection_lists(total, hk, args.count, gen)
            kept = kept_pairs(sel) * hq
            causal_kept = hq * total * (total + 1) // 2
            if args.topk:
                _bench_topk(rows, impls, q, k, cu, total, hq, hk, args, start)
                continue
            check_rows = min(total, 2048)
            want = None
            timings = {}
            for impl in impls:
                for direction in ("fwd", "fwd+bwd") if args.backward else ("fwd",):
                    row = dict(T=total, H_q=hq, H_k=hk, impl=impl, direction=direction)
                    if time.time() - start > args.budget_s:
                        keep_row(rows, dict(row, skipped="time budget"), args.out)
                        continue
                    try:
                        fn, out_of = _call(impl, q, k, v, sel, cu, total, hq, hk, args, direction)
                    except Exception as e:  # noqa: BLE001  (a peer that cannot run this point)
                        keep_row(rows, dict(row, skipped=f"{type(e).__name__}: {e}"[:200]), args.out)
                        continue
                    if fn is None:
                        keep_row(rows, dict(row, skipped=out_of), args.out)
                        continue
                    try:
                        sec = seconds_per_call(fn, args.rep)
                        flops = 4 * d * (causal_kept if impl.endswith("causal") else kept)
                        flops *= 3.5 if direction == "fwd+bwd" else 1.0
                        row.update(ms=round(sec * 1e3, 4), tflops=round(flops / sec / 1e12, 1))
                        timings[(impl, direction)] = sec
                        if args.profile and impl == "fmha":
                            row["kernels"] = profile_point(fn, torch, steps=3)
                        if not impl.endswith("causal") and direction == "fwd":
                            o = out_of().float()[:check_rows]
                            if want is None:
                                want = nsa.selection_attention(q[:check_rows].float(), k[:check_rows].float(),
                                                               v[:check_rows].float(), sel[:check_rows],
                                                               torch.tensor([0, check_rows], dtype=torch.int32,
                                                                            device="cuda"),
                                                               BLOCK, backend="reference")[0]
                            row["err"] = float((o - want).norm() / want.norm())
                        base = timings.get(("fmha_causal", direction))
                        if base:
                            row["speedup_vs_fmha_causal"] = round(base / sec, 2)
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {e}"[:300]
                    keep_row(rows, row, args.out)
    print(f"done in {time.time() - start:.0f} s")


def _topk_graph(q, k_cmp, lse, cu, cu_cmp, total, count):
    """fmha's top-k op replayed from a CUDA graph (no checks, no launch cost): returns the replay,
    which returns the captured output."""
    def step():
        return torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, BLOCK, BLOCK, BLOCK, count,
                                                q.shape[-1] ** -0.5, "kernel", total)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = step()
    torch.cuda.current_stream().wait_stream(stream)

    def replay():
        graph.replay()
        return out
    return replay


def _bench_topk(rows, impls, q, k, cu, total, hq, hk, args, start):
    """Rows of direction "topk" for one point (module doc)."""
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, BLOCK, BLOCK)
    v_cmp = k_cmp
    lse = nsa.compression_attention(q, k_cmp, v_cmp, cu, cu_cmp, BLOCK, BLOCK, backend="kernel")[1]
    mine = None
    for impl in impls:
        row = dict(T=total, H_q=hq, H_k=hk, impl=impl, direction="topk")
        if time.time() - start > args.budget_s:
            keep_row(rows, dict(row, skipped="time budget"), args.out)
            continue
        if impl == "fmha":
            def run():
                return nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, BLOCK, BLOCK, BLOCK, args.count, backend="kernel")
        elif impl == "fmha_nosync":
            def run():
                return nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, BLOCK, BLOCK, BLOCK, args.count, backend="kernel",
                                         max_seqlen=total)
        elif impl == "fmha_graph":
            run = _topk_graph(q, k_cmp, lse, cu, cu_cmp, total, args.count)
        elif impl == "fmha_torch":
            if total > args.torch_max:
                keep_row(rows, dict(row, skipped=f"T > --torch-max {args.torch_max}"), args.out)
                continue

            def run():
                return nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, BLOCK, BLOCK, BLOCK, args.count,
                                         backend="reference")
        elif impl == "fla":
            from fla.ops.nsa.parallel import parallel_nsa_topk

            if hq // hk < 16 or (hq // hk) & (hq // hk - 1):
                keep_row(rows, dict(row, skipped="fla's NSA needs H_q/H_k a power of two >= 16"), args.out)
                continue
            lse_fla = lse.T.contiguous()[None]

            def run():
                return parallel_nsa_topk(q[None], k_cmp[None], total, lse_fla, args.count, BLOCK,
                                         q.shape[-1] ** -0.5)[0]
        else:
            keep_row(rows, dict(row, skipped="--topk times fmha and fla"), args.out)
            continue
        try:
            sec = seconds_per_call(run, args.rep)
            row["ms"] = round(sec * 1e3, 4)
            got = run().long()
            if impl == "fmha":
                mine = got
            elif mine is not None:
                ours = torch.where(mine >= 0, mine, 1 << 30).sort(-1).values
                theirs = torch.where(got >= 0, got, 1 << 30).sort(-1).values[..., :ours.shape[-1]]
                row["same_lists"] = round(float((ours == theirs).all(-1).float().mean()), 4)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        keep_row(rows, row, args.out)


def table(rows) -> str:
    """Markdown: per point and direction, each impl's TFLOP/s and its time against fmha's kernel
    form and dense causal fmha."""
    done = {(r["T"], r["H_q"], r["H_k"], r["direction"], r["impl"]): r for r in rows if "ms" in r}
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    head = ["T", "H_q/H_k", "direction"] + [f"{i} TFLOP/s" for i in impls]
    head += ["fmha / fla", "fmha / fmha_causal", "fla / fmha_causal"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in dict.fromkeys((r["T"], r["H_q"], r["H_k"], r["direction"]) for r in rows):
        got = {i: done.get(point + (i,)) for i in impls}
        if not any(got.values()):
            continue

        def ratio(a, b):
            return f"{got[b]['ms'] / got[a]['ms']:.2f}x" if got.get(a) and got.get(b) else "-"
        cells = [str(point[0]), f"{point[1]}/{point[2]}", point[3]]
        cells += [(f"{got[i]['tflops']}" if "tflops" in got[i] else f"{got[i]['ms']} ms") if got[i] else "-"
                  for i in impls]
        cells += [ratio("fmha", "fla"), ratio("fmha", "fmha_causal"), ratio("fla", "fmha_causal")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _call(impl, q, k, v, sel, cu, total, hq, hk, args, direction):
    """(the timed function, a function returning its output) of ``impl``, or (None, why not)."""
    grad = direction == "fwd+bwd"
    leaves = [t.detach().clone().requires_grad_(grad) for t in (q, k, v)]
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), device="cuda", dtype=q.dtype) if grad else None
    if impl == "fmha":
        def run():
            return nsa.selection_attention(*leaves, sel, cu, BLOCK, backend="kernel")[0]
    elif impl == "fmha_bwd_block_mask":
        if not grad:
            return None, "fwd+bwd only (the forward is fmha's)"

        def run():
            return nsa.selection_attention(q, k, v, sel, cu, BLOCK, backend="kernel")[0]

        def step():
            o, lse = nsa.selection_attention(q, k, v, sel, cu, BLOCK, backend="kernel")
            selection_backward_block_mask(dout, q, k, v, o, lse, None, sel, cu, BLOCK, q.shape[-1] ** -0.5)
        return step, run
    elif impl == "fmha_block_mask":  # the form before the selection kernel: the lists as a block mask
        if grad:
            return None, "forward only (fmha_bwd_block_mask times that backward)"
        if total > args.torch_max:
            return None, f"T > --torch-max {args.torch_max}"

        def run():
            return selection_forward_block_mask(q, k, v, sel, cu, BLOCK, q.shape[-1] ** -0.5)[0]
    elif impl == "fmha_torch":
        if total > args.torch_max:
            return None, f"T > --torch-max {args.torch_max}"

        def run():
            return nsa.selection_attention(*leaves, sel, cu, BLOCK, backend="reference")[0]
    elif impl == "fla":
        from fla.ops.nsa import parallel_nsa

        if hq // hk < 16 or (hq // hk) & (hq // hk - 1):
            return None, "fla's NSA needs H_q/H_k a power of two >= 16"
        indices = sel.long().clamp(min=0)[None]
        counts = (sel >= 0).sum(-1)[None]

        def run():
            return parallel_nsa(*(t[None] for t in leaves), block_indices=indices, block_counts=counts,
                                block_size=BLOCK)[0]
    elif impl == "fmha_causal":
        def run():
            return fmha.attention(*(t[None] for t in leaves), causal=True)[0]
    elif impl == "fa4_causal":
        from flash_attn.cute import flash_attn_func

        def run():
            out = flash_attn_func(*(t[None] for t in leaves), causal=True)
            return (out[0] if isinstance(out, tuple) else out)[0]
    else:
        return None, f"unknown implementation {impl}"
    if not grad:
        return run, run

    def step():
        for t in leaves:
            t.grad = None
        run().backward(dout)
    return step, run


if __name__ == "__main__":
    main()
