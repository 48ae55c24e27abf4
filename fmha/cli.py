"""``python -m fmha``: run one attention configuration on random inputs, check it against the
fp64 reference, and time it (the seed's example driver).

Exit status: 0 verified (or check skipped), 1 check failed, 2 bad arguments or, with
``--backend kernel``, no kernel for the configuration.

Varlen: ``--varlen_q``/``--varlen_k`` give the per-sequence lengths; B of both shapes must equal the
number of lengths, and the shape's S is used only for a side whose list is not given (every
sequence then has that length).

Programmable attention: ``--score_mod alibi`` or ``softcap:C``, ``--mask_mod causal``, ``window:W``
(the W keys before each query and itself) or ``document:N`` (N packed documents of random lengths),
as ``fmha.mods`` functions run in the kernel and in the reference; ``--block_mask`` also builds a
block mask from the mask mod (``fmha.create_block_mask``), so that blocks it drops are skipped.

KV cache: ``--kvcache`` runs ``fmha.attention_with_kvcache``: ``--k_shape`` is the cache (every
sequence holds S_k keys), the query rows follow it (``--is_causal`` and ``--window_size`` are
bottom-right aligned), and ``--page_size N`` stores it in pages of N rows, in shuffled order.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import List, Optional

import torch

from .api import FusedAttention
from .backends import UnsupportedError
from .problem import default_out_dtype, accumulate_dtype
from .reference import attention_reference
from .validation import lse_shape, out_shape

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float32": torch.float32,
    "float64": torch.float64,
}
#: default --tolerance (relative L2 error of O) by output dtype: a few ulps of the output format
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 2e-2, torch.float8_e4m3fn: 1e-1, torch.float32: 1e-5,
             torch.float64: 1e-12}
#: fp8 inputs: P is rounded to fp8 with a running (not the final) row max in a kernel
FP8_INPUT_TOLERANCE = 5e-2


def _ints(text: str, count: Optional[int] = None) -> List[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if count is not None and len(values) != count:
        raise argparse.ArgumentTypeError(f"expected {count} comma-separated integers, got {text!r}")
    return values


def _shape(text):
    values = _ints(text, 4)
    if any(x < 0 for x in values):
        raise argparse.ArgumentTypeError(f"a shape's sizes must be >= 0 (B,S,H,D), got {text!r}")
    return values


def _pair(text):
    return _ints(text, 2)


#: options whose comma-separated values may start with a dash
_LIST_OPTIONS = ("--window_size", "--q_shape", "--k_shape")


def _values_joined(argv: list) -> list:
    """``--window_size -1,8`` as ``--window_size=-1,8``: argparse reads a value that starts with
    a dash (and is not a plain negative number) as an option."""
    out = []
    for i, token in enumerate(argv):
        if i and argv[i - 1] in _LIST_OPTIONS and token.startswith("-") and out and out[-1] == argv[i - 1]:
            out[-1] = f"{argv[i - 1]}={token}"
        else:
            out.append(token)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fmha", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--q_shape", type=_shape, required=True, metavar="B,S,H,D")
    p.add_argument("--k_shape", type=_shape, default=None, metavar="B,S,H,D",
                   help="default: q_shape")
    p.add_argument("--v_head_dim", type=int, default=None, metavar="D_V",
                   help="V's (and O's) head dim, e.g. 128 beside a D of 192 (default: k_shape's D)")
    p.add_argument("--is_causal", action="store_true")
    p.add_argument("--is_persistent", action="store_true",
                   help="ask for the persistent kernel (default: the backend's choice)")
    p.add_argument("--window_size", type=_pair, default=None, metavar="L,R",
                   help="sliding window; -1 = unbounded side")
    p.add_argument("--bottom_right_align", action="store_true")
    p.add_argument("--compressed_causal", action="store_true")
    p.add_argument("--in_dtype", choices=DTYPES, default="float16")
    p.add_argument("--out_dtype", choices=DTYPES, default=None,
                   help="default: the input dtype (bfloat16 for fp8 input)")
    for name in ("scale_q", "scale_k", "scale_v", "inv_scale_o"):
        p.add_argument(f"--{name}", type=float, default=1.0)
    p.add_argument("--scale_softmax", type=float, default=None, help="default: 1/sqrt(D)")
    p.add_argument("--softcap", type=float, default=0.0, help="cap the scaled scores at C * tanh(s / C) (0: none)")
    p.add_argument("--sinks", action="store_true", help="a random sink logit per query head (gpt-oss)")
    p.add_argument("--score_mod", default=None, metavar="alibi|softcap:C",
                   help="a score_mod: ALiBi (slope 2^(-8(h+1)/H) per head) or C * tanh(s / C)")
    p.add_argument("--mask_mod", default=None, metavar="causal|window:W|document:N",
                   help="a mask_mod: causal, a causal window of W keys back, or N packed documents")
    p.add_argument("--block_mask", action="store_true", help="build a block mask from --mask_mod (dense only)")
    p.add_argument("--mma_tiler_mn", type=_pair, default=None, metavar="M,N")
    p.add_argument("--varlen_q", type=_ints, default=None, metavar="L1,L2,...")
    p.add_argument("--varlen_k", type=_ints, default=None, metavar="L1,L2,...")
    p.add_argument("--lse", action="store_true", help="also compute and check the LSE")
    p.add_argument("--kvcache", action="store_true", help="attend the query rows to a KV cache of --k_shape")
    p.add_argument("--page_size", type=int, default=None, help="with --kvcache: a paged cache of pages this long")
    p.add_argument("--backend", choices=("auto", "kernel", "reference"), default="auto")
    p.add_argument("--warmup_iterations", type=int, default=1)
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--skip_ref_check", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=None,
                   help="max relative L2 error of O (default: by dtype)")
    args = p.parse_args(_values_joined(sys.argv[1:] if argv is None else list(argv)))
    if args.page_size is not None and not 1 <= args.page_size <= 256:
        p.error(f"--page_size must be from 1 to 256, got {args.page_size}")
    if args.page_size is not None and not args.kvcache:
        p.error("--page_size pages the KV cache of --kvcache")
    if args.k_shape is None:
        args.k_shape = list(args.q_shape)
    for flag, kinds in (("score_mod", SCORE_MODS), ("mask_mod", MASK_MODS)):
        text = getattr(args, flag)
        if text is not None:
            name, _, value = text.partition(":")
            needs_value = kinds.get(name)
            if needs_value is None or bool(value) != needs_value:
                p.error(f"--{flag} takes one of {', '.join(n + (':N' if v else '') for n, v in kinds.items())}; "
                        f"got {text!r}")
            if value:
                try:
                    number = float(value) if name == "softcap" else int(value)
                except ValueError:
                    p.error(f"--{flag} {name}: expects a number after the colon, got {value!r}")
                if number < 0 or (name == "softcap" and number == 0) or (name == "document" and number == 0):
                    p.error(f"--{flag} {name}:{value}: the number must be positive ({'C > 0' if name == 'softcap' else 'W >= 0' if name == 'window' else 'N >= 1'})")
    if args.block_mask and args.mask_mod is None:
        p.error("--block_mask is built from --mask_mod; give one")
    if args.kvcache and (args.score_mod or args.mask_mod):
        p.error("--kvcache serves the built-in masks; --score_mod/--mask_mod run without it")
    if args.iterations < 1 or args.warmup_iterations < 0:
        p.error("--iterations must be >= 1 and --warmup_iterations >= 0")
    for flag in ("varlen_q", "varlen_k"):
        lens = getattr(args, flag)
        if lens is not None and any(n < 0 for n in lens):
            p.error(f"--{flag} lengths must be >= 0")
    return args


#: --score_mod / --mask_mod names: whether each takes a value after a colon
SCORE_MODS = {"alibi": False, "softcap": True}
MASK_MODS = {"causal": False, "window": True, "document": True}


def named_mods(args, num_heads: int, positions: int, device) -> tuple:
    """(score_mod, mask_mod) that ``--score_mod`` / ``--mask_mod`` name, as ``fmha.mods``
    functions; the tensors they read (ALiBi's slopes, the documents' ids over ``positions``) are
    captured, so the kernel receives them without ``aux=``."""
    score_mod = _named_score_mod(args.score_mod, num_heads, device) if args.score_mod else None
    mask_mod = _named_mask_mod(args.mask_mod, positions, args.seed, device) if args.mask_mod else None
    return score_mod, mask_mod


def _named_score_mod(spec: str, num_heads: int, device):
    from . import mods as M

    name, _, value = spec.partition(":")
    if name == "alibi":
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], device=device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slopes[h] * (kv_idx - q_idx)
        return score_mod
    cap = float(value)

    def score_mod(score, b, h, q_idx, kv_idx):
        return cap * M.tanh(score / cap)
    return score_mod


def _named_mask_mod(spec: str, positions: int, seed: int, device):
    name, _, value = spec.partition(":")
    if name == "causal":
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx
        return mask_mod
    if name == "window":
        width = int(value)

        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= width)
        return mask_mod
    count = max(1, int(value))
    gen = torch.Generator().manual_seed(seed + 3)
    starts = torch.randperm(max(positions - 1, 1), generator=gen)[:count - 1] + 1
    ids = torch.zeros(max(positions, 1), dtype=torch.int32)
    ids[starts[starts < positions]] = 1
    docs = ids.cumsum(0).to(torch.int32).to(device)

    def mask_mod(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx]
    return mask_mod


def _random(shape, dtype, gen, device):
    if dtype == torch.float8_e4m3fn:
        # fp8 has no randn; a symmetric range keeps scores of both signs and away from all-zero
        x = torch.empty(shape).uniform_(-2.0, 2.0, generator=gen)
    else:
        x = torch.randn(shape, generator=gen)
    return x.to(dtype).to(device)


def _seq_lengths(args):
    """(lens_q, lens_k) for varlen, else None."""
    if args.varlen_q is None and args.varlen_k is None:
        return None
    bq, bk = args.q_shape[0], args.k_shape[0]
    lens_q = args.varlen_q if args.varlen_q is not None else [args.q_shape[1]] * bq
    lens_k = args.varlen_k if args.varlen_k is not None else [args.k_shape[1]] * bk
    if not len(lens_q) == len(lens_k) == bq == bk:
        raise ValueError(
            f"varlen: B of --q_shape ({bq}) and --k_shape ({bk}) must equal the number of "
            f"lengths in --varlen_q ({len(lens_q)}) and --varlen_k ({len(lens_k)})"
        )
    return lens_q, lens_k


def _make_inputs(args, device):
    gen = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.in_dtype]
    _, sq, hq, d = args.q_shape
    _, sk, hk, dk = args.k_shape
    lens = _seq_lengths(args)
    if lens is None:
        q_shape, kv_shape, cu_q, cu_k = tuple(args.q_shape), tuple(args.k_shape), None, None
    else:
        q_shape, kv_shape = (sum(lens[0]), hq, d), (sum(lens[1]), hk, dk)
        cu_q, cu_k = (
            torch.tensor([0] + list(_cumsum(ls)), dtype=torch.int32, device=device) for ls in lens
        )
    q = _random(q_shape, dtype, gen, device)
    k = _random(kv_shape, dtype, gen, device)
    v_shape = kv_shape if args.v_head_dim is None else kv_shape[:-1] + (args.v_head_dim,)
    v = _random(v_shape, dtype, gen, device)
    return q, k, v, cu_q, cu_k, lens


def _cumsum(values):
    total = 0
    for x in values:
        total += x
        yield total


def _special_mismatches(a: torch.Tensor, b: torch.Tensor) -> int:
    """Positions where a and b disagree on being NaN, +inf or -inf."""
    bad = torch.zeros(a.shape, dtype=torch.bool, device=a.device)
    for test in (torch.isnan, torch.isposinf, torch.isneginf):
        bad |= test(a) != test(b)
    return int(bad.sum())


def check(out, lse, ref_o, ref_lse, tolerance: float) -> tuple:
    """(passed, one-line summary) comparing outputs with the fp64 reference."""
    o = out.to(torch.float64)
    ref_o = ref_o.to(o.device)
    special = _special_mismatches(o, ref_o)
    both = torch.isfinite(o) & torch.isfinite(ref_o)
    diff = torch.where(both, o - ref_o, torch.zeros_like(o))
    ref_norm = float(torch.where(both, ref_o, torch.zeros_like(o)).norm())
    rel_l2 = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    max_abs = float(diff.abs().max()) if diff.numel() else 0.0
    passed = special == 0 and rel_l2 <= tolerance
    parts = [f"O rel L2 err {rel_l2:.3e} (tol {tolerance:.1e})", f"max abs err {max_abs:.3e}"]
    if lse is not None:
        l = lse.to(torch.float64)
        ref_lse = ref_lse.to(l.device)
        special += _special_mismatches(l, ref_lse)
        fin = torch.isfinite(l) & torch.isfinite(ref_lse)
        lse_err = float((l - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
        scale = max(1.0, float(ref_lse[fin].abs().max())) if bool(fin.any()) else 1.0
        lse_tol = 1e-3 * scale
        passed = passed and special == 0 and lse_err <= lse_tol
        parts.append(f"LSE max abs err {lse_err:.3e} (tol {lse_tol:.1e})")
    parts.append("NaN/inf patterns agree" if special == 0 else f"{special} NaN/inf mismatches")
    return passed, ", ".join(parts)


def _time_per_call(fn, warmup: int, iterations: int, device) -> tuple:
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iterations):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iterations, "CUDA events"
    t0 = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - t0) / iterations, "perf_counter"


def _paged(k, v, page_size: int, gen):
    """The dense cache (B, S, H, D) as pages of ``page_size`` rows in shuffled order, and the
    block table."""
    b, s = k.shape[:2]
    per_seq = -(-s // page_size)
    order = torch.randperm(b * per_seq, generator=gen).to(k.device)
    kp = torch.zeros((b * per_seq, page_size) + tuple(k.shape[2:]), dtype=k.dtype, device=k.device)
    vp = torch.zeros((b * per_seq, page_size) + tuple(v.shape[2:]), dtype=v.dtype, device=v.device)
    table = order.view(b, per_seq).to(torch.int32)
    for i in range(b):
        for j in range(per_seq):
            rows = slice(j * page_size, min((j + 1) * page_size, s))
            kp[table[i, j], : rows.stop - rows.start] = k[i, rows]
            vp[table[i, j], : rows.stop - rows.start] = v[i, rows]
    return kp, vp, table


def run_kvcache(args) -> int:
    from .kvcache import attention_with_kvcache, decode_backend, decode_problem
    from .masking import MaskSpec

    if args.varlen_q or args.varlen_k or args.compressed_causal:
        raise ValueError("--kvcache takes dense --q_shape/--k_shape and causal or window masks")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, _, _, _ = _make_inputs(args, device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    lens = torch.full((q.shape[0],), k.shape[1], dtype=torch.int32, device=device)
    k_cache, v_cache, table = k, v, None
    if args.page_size:
        k_cache, v_cache, table = _paged(k, v, args.page_size, gen)
    window = (None, None) if args.window_size is None else tuple(None if w == -1 else w for w in args.window_size)
    sinks = None
    if args.sinks:
        sinks = torch.randn(q.shape[-2], generator=torch.Generator().manual_seed(args.seed + 2)).to(device)
    kwargs = dict(causal=args.is_causal, window_size=window, softmax_scale=args.scale_softmax, scale_q=args.scale_q,
                  scale_k=args.scale_k, scale_v=args.scale_v, inv_scale_o=args.inv_scale_o, softcap=args.softcap,
                  sinks=sinks, out_dtype=DTYPES[args.out_dtype] if args.out_dtype else None)
    kind = f"paged ({args.page_size} rows a page)" if table is not None else "dense"
    print(f"fmha: KV cache, q {tuple(q.shape)}, {kind} cache of {k.shape[1]} keys x {k.shape[2]} heads per sequence")
    problem, _ = decode_problem(q, k_cache, v_cache, lens, block_table=table, return_lse=args.lse, **kwargs)
    name, reasons = decode_backend(args.backend, problem)
    if device.type == "cpu":
        print("no CUDA GPU: running the PyTorch reference on the CPU")
    print(f"backend: {name}")
    if reasons and args.backend != "reference":
        print("kernel not used:\n" + "\n".join(f"  - {r}" for r in reasons))

    def call():
        return attention_with_kvcache(q, k_cache, v_cache, lens, block_table=table, return_lse=args.lse,
                                      backend=args.backend, **kwargs)

    result = call()
    o, lse = result if args.lse else (result, None)
    seconds, clock = _time_per_call(call, args.warmup_iterations, args.iterations, device)
    flops = problem.flops(lens.tolist())
    print(f"time: {seconds * 1e3:.3f} ms per call ({clock}, {args.iterations} iterations after "
          f"{args.warmup_iterations} warmup), {flops / seconds / 1e12:.3f} TFLOP/s")
    if args.skip_ref_check:
        print("reference check skipped")
        return 0
    mask = MaskSpec.from_args(args.is_causal, window, "bottom_right", False)
    ref_o, ref_lse = attention_reference(q, k, v, mask=mask, softmax_scale=args.scale_softmax, scale_q=args.scale_q,
                                         scale_k=args.scale_k, scale_v=args.scale_v, inv_scale_o=args.inv_scale_o,
                                         softcap=args.softcap, sinks=sinks, compute_dtype=torch.float64)
    tolerance = args.tolerance if args.tolerance is not None else TOLERANCE[o.dtype]
    passed, summary = check(o, lse, ref_o, ref_lse, tolerance)
    print(f"check vs fp64 reference over the dense keys: {summary}")
    print("verified" if passed else "FAILED: outside tolerance")
    return 0 if passed else 1


def run(args) -> int:
    if args.kvcache:
        return run_kvcache(args)
    if args.page_size is not None:
        raise ValueError("--page_size needs --kvcache")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, k, v, cu_q, cu_k, lens = _make_inputs(args, device)
    window = (None, None)
    if args.window_size is not None:
        window = tuple(None if w == -1 else w for w in args.window_size)
    out_dtype = DTYPES[args.out_dtype] if args.out_dtype else default_out_dtype(q.dtype)
    kwargs = dict(
        causal=args.is_causal, window_size=window,
        mask_align="bottom_right" if args.bottom_right_align else "top_left",
        compressed_causal=args.compressed_causal, softmax_scale=args.scale_softmax,
        scale_q=args.scale_q, scale_k=args.scale_k, scale_v=args.scale_v,
        inv_scale_o=args.inv_scale_o, softcap=args.softcap,
    )
    sinks = None
    if args.sinks:
        sinks = torch.randn(q.shape[-2], generator=torch.Generator().manual_seed(args.seed + 2)).to(device)
    positions = max(max(lens[0] + lens[1], default=0) if lens is not None else 0, q.shape[-3], k.shape[-3])
    score_mod, mask_mod = named_mods(args, q.shape[-2], positions, device)
    block_mask = None
    if args.block_mask:
        if lens is not None:
            raise ValueError("--block_mask takes dense inputs (block masks do not take varlen batches)")
        from .block_mask import create_block_mask

        block_mask = create_block_mask(mask_mod, q.shape[0], None, q.shape[1], k.shape[1], device=device)
        mask_mod = None  # the block mask brings it
    kwargs.update(score_mod=score_mod, mask_mod=mask_mod)
    o = torch.empty(out_shape(q, v.shape[-1]), dtype=out_dtype, device=device)
    lse = None
    if args.lse:
        lse = torch.empty(lse_shape(q, lens is not None), dtype=accumulate_dtype(q.dtype), device=device)
    fa = FusedAttention(q, k, v, o, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks, block_mask=block_mask,
                        backend=args.backend, persistent=True if args.is_persistent else None,
                        tile_mn=tuple(args.mma_tiler_mn) if args.mma_tiler_mn else None, **kwargs)
    problem = fa.problem
    print(f"fmha: {problem.describe()}")
    if device.type == "cpu":
        print("no CUDA GPU: running the PyTorch reference on the CPU")
    reasons = []
    if args.backend != "reference":
        try:
            fa.check_support()
        except UnsupportedError as e:
            reasons = e.reasons
    fa.compile()
    print(f"backend: {fa.backend_name}")
    if reasons:
        print("kernel not used:\n" + "\n".join(f"  - {r}" for r in reasons))

    fa.execute(q, k, v, o, lse, cu_q, cu_k, sinks=sinks)  # checked once; the timed calls skip the checks

    def call():
        fa.execute(q, k, v, o, lse, cu_q, cu_k, sinks=sinks, check=False)

    seconds, clock = _time_per_call(call, args.warmup_iterations, args.iterations, device)
    flops = problem.flops(*(lens if lens is not None else (None, None)))
    if fa.mods is not None and (fa.mods.mask_mod is not None or fa.mods.block_mask is not None):
        from .reference import kept_triples_with_mods

        seq_q, seq_k = lens if lens is not None else ([problem.seqlen_q] * problem.batch,
                                                      [problem.seqlen_k] * problem.batch)
        flops = problem.flops(kept_triples=kept_triples_with_mods(fa.mods, problem.mask, seq_q, seq_k,
                                                                problem.num_heads_q, device))
    print(f"time: {seconds * 1e3:.3f} ms per call ({clock}, {args.iterations} iterations after "
          f"{args.warmup_iterations} warmup), {flops / seconds / 1e12:.3f} TFLOP/s")

    if args.skip_ref_check:
        print("reference check skipped")
        return 0
    if fa.backend_name == "reference":
        print("note: the backend is the fp32 reference: the check compares it with the fp64 one")
    ref_o, ref_lse = attention_reference(
        q, k, v, cu_q, cu_k, mask=problem.mask, softmax_scale=problem.softmax_scale,
        scale_q=problem.scale_q, scale_k=problem.scale_k, scale_v=problem.scale_v,
        inv_scale_o=problem.inv_scale_o, softcap=problem.softcap, sinks=sinks, compute_dtype=torch.float64,
        mods=fa.mods,
    )
    tolerance = args.tolerance
    if tolerance is None:
        tolerance = TOLERANCE[problem.out_dtype]
        if problem.is_fp8:
            tolerance = max(tolerance, FP8_INPUT_TOLERANCE)
    passed, summary = check(o, lse, ref_o, ref_lse, tolerance)
    print(f"check vs fp64 reference: {summary}")
    print("verified" if passed else "FAILED: outside tolerance")
    return 0 if passed else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    # run() prints why the kernel was not used; the library's fallback warnings would repeat it.
    logging.getLogger("fmha").setLevel(logging.ERROR)
    try:
        return run(args)
    except (UnsupportedError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
