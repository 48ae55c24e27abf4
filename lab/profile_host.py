"""Where an eager call's host time goes (GPU machine): one decode or forward point called in a
loop, its host time per call (``perf_counter`` over calls that are not synchronized, so the
GPU's time hides only where the host is faster), its GPU time per call replayed in a CUDA graph,
its eager time as ``lab.bench_decode`` takes it (``do_bench``: one call at a time), any call that
synchronizes the host with the GPU (``torch.cuda.set_sync_debug_mode``), and a
``cProfile`` of the loop.

    python -m lab.profile_host --point decode --batch 16 --seqlen-q 1 --seqlen-k 8192 --out $OUT/host
    python -m lab.profile_host --point decode --page-size 64 ...

``--stubbed`` (any machine, no GPU): the decode call's own Python time, on CPU tensors, with the
Hopper decode runner's kernel launches and the device error flag's copies replaced by no-ops;
what the library adds per call before the driver, apart from torch's CUDA costs.

    python -m lab.profile_host --stubbed [--seqlen-q 1] [--page-size 64]
"""

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_call(args):
    import torch

    import fmha

    g = torch.Generator(device="cuda").manual_seed(0)
    b, sq, sk, hq, hk, d = args.batch, args.seqlen_q, args.seqlen_k, args.heads_q, args.heads_k, args.head_dim
    q = torch.randn(b, sq, hq, d, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, sk, hk, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(q)
    if args.point == "forward":
        return lambda: fmha.attention(q, k, v, causal=True, out=out, backend="kernel")
    lengths = torch.full((b,), sk - args.append, dtype=torch.int32, device="cuda")
    new = {}
    if args.append:  # the step's keys written into the cache first (at the same places every call)
        new = dict(k_new=torch.randn(b, args.append, hk, d, generator=g, device="cuda", dtype=torch.bfloat16),
                   v_new=torch.randn(b, args.append, hk, d, generator=g, device="cuda", dtype=torch.bfloat16))
    if not args.page_size:
        return lambda: fmha.attention_with_kvcache(q, k, v, lengths, out=out, backend="kernel", **new)
    per_seq = sk // args.page_size
    order = torch.randperm(b * per_seq, device="cuda")
    kp = torch.empty((b * per_seq, args.page_size, hk, d), dtype=k.dtype, device="cuda")
    vp = torch.empty_like(kp)
    kp[order], vp[order] = k.reshape(-1, args.page_size, hk, d), v.reshape(-1, args.page_size, hk, d)
    table = order.view(b, per_seq).to(torch.int32)
    return lambda: fmha.attention_with_kvcache(q, kp, vp, lengths, block_table=table, out=out, backend="kernel",
                                               **new)


def stubbed_host_us(args, rounds: int = 5) -> float:
    """Median over ``rounds`` of the Python time per decode call with the launches stubbed."""
    import statistics

    import torch

    import fmha
    from fmha import device_errors, kvcache
    from fmha.kernels.hopper import decode_runner

    flag = torch.zeros(1, dtype=torch.int32)
    decode_runner.sm_count = lambda device: 132
    device_errors.flag = lambda device: flag
    device_errors.raise_pending = device_errors.watch = lambda device: None
    b, sq, sk, hq, hk, d = args.batch, args.seqlen_q, args.seqlen_k, args.heads_q, args.heads_k, args.head_dim
    q = torch.randn(b, sq, hq, d).to(torch.bfloat16)
    lengths = torch.full((b,), sk, dtype=torch.int32)
    table = None
    if args.page_size:
        k = torch.zeros(b * sk // args.page_size, args.page_size, hk, d, dtype=torch.bfloat16)
        table = torch.arange(b * sk // args.page_size, dtype=torch.int32).view(b, -1)
    else:
        k = torch.zeros(b, sk, hk, d, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    problem, _ = kvcache.decode_problem(q, k, k, lengths, block_table=table)
    runner = decode_runner.HopperDecodeRunner(problem)
    runner.load = lambda cfg, compile_fn: (lambda *arguments: None)
    kvcache._decode_runner = lambda backend, problem: runner  # the CPU has no kernel backend to select

    def call():
        fmha.attention_with_kvcache(q, k, k, lengths, block_table=table, out=out, backend="kernel")

    for _ in range(200):
        call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        times.append((time.perf_counter() - start) / args.calls * 1e6)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--point", choices=["decode", "forward"], default="decode")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen-q", type=int, default=1)
    ap.add_argument("--seqlen-k", type=int, default=8192)
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-k", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=0)
    ap.add_argument("--append", type=int, default=0, help="decode: new keys per sequence (k_new/v_new)")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default="")
    ap.add_argument("--stubbed", action="store_true", help="decode's Python time with the launches stubbed (CPU)")
    args = ap.parse_args(argv)
    if args.stubbed:
        print(json.dumps(dict(vars(args), stubbed_host_us_per_call=round(stubbed_host_us(args), 1))))
        return
    import torch

    call = make_call(args)
    call()
    torch.cuda.synchronize()
    # host time: the loop is not synchronized, so it measures the host where it is the slower one
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    host_us = (time.perf_counter() - start) / args.calls * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        call()
        with torch.cuda.graph(graph, stream=stream):
            call()
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(args.calls):
        graph.replay()
    end_ev.record()
    torch.cuda.synchronize()
    gpu_us = start_ev.elapsed_time(end_ev) / args.calls * 1e3
    from triton.testing import do_bench

    eager_us = do_bench(call, warmup=25, rep=200, return_mode="median") * 1e3  # one call at a time, L2 flushed
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:300] for w in caught if "synchroniz" in str(w.message).lower()]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    row = dict(vars(args), host_us_per_call=round(host_us, 1), graph_gpu_us_per_call=round(gpu_us, 1),
               eager_us_per_call=round(eager_us, 1), synchronizing_calls=syncs)
    print(json.dumps(row))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = f"{args.point}_b{args.batch}_sq{args.seqlen_q}_sk{args.seqlen_k}_p{args.page_size}_new{args.append}"
        with open(os.path.join(args.out, tag + ".json"), "w") as f:
            json.dump(row, f, indent=1)
        with open(os.path.join(args.out, tag + "_cprofile.txt"), "w") as f:
            f.write(text.getvalue())
    else:
        print(text.getvalue()[:6000])


if __name__ == "__main__":
    main()
