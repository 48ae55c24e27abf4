"""Programmable attention (score_mod / mask_mod / block-sparse masks) against its peers, side by side
in one process. bf16, D=128, H_q=H_k=16, B*S = 32768 tokens a point. Implementations: ``fmha``
(its mods and block mask), ``fmha_builtin`` (causal / window_size / packed-document varlen: the
same mask without a mod), ``flex`` (FlexAttention under torch.compile, BHSD views, its own block
mask), ``fa4`` (FlashAttention-4's CuTe-DSL mods, block-sparse tensors from FlexAttention's mask),
``fa4_builtin`` (FA4's causal / window / varlen; opt-in).

Cases: ``document`` (20 packed documents of seeded random lengths, one layout for every batch row,
causal inside a document), ``alibi`` (causal + ALiBi, slopes 2^(-8(h+1)/H)), ``sliding_window``
(causal, keys at most 1024 back), ``causal_as_mask_mod``.

FLOPs count the (row, key) pairs the mask keeps, whatever an implementation skips or recomputes:
fwd 4*B*H*D*kept, fwd+bwd 3.5x that (the backward 10*B*H*D*kept; lab/bench_masks.py's convention).
A row: ms (median, lab/timing), TFLOP/s, ``err`` (relative L2 error of the output against an fp32
reference in plain torch math, not through the mods, on the last batch row's heads 0 and H-1, first
and last 256 query rows), ``err_dq`` (fwd+bwd: dQ on that slice), ``build_ms`` (block mask, a
second build after one that compiles; not in ms), ``first_s`` (the first call: compiles), or
``error`` / ``skipped`` (the run goes on).

    python lab/bench_mods.py --backward --out results/bench/mods/mods.json   # FA4 importable for its rows
    python lab/plot_mods.py results/bench/mods/mods.json --out results/bench/mods/mods.png
"""

import argparse
import gc
import inspect
import os
import sys
import time
import warnings
from importlib.metadata import version

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import fmha  # noqa: E402
from lab.timing import keep_row, seconds_per_call  # noqa: E402

CASES = ("document", "alibi", "sliding_window", "causal_as_mask_mod")
IMPLS = ("fmha", "fmha_builtin", "flex", "fa4", "fa4_builtin")
H, D, TOKENS, N_DOCS, WINDOW, EDGE = 16, 128, 32768, 20, 1024, 256
CHECK_HEADS = (0, H - 1)


# fmha's mods: FlexAttention's signature, aux tensors as a trailing argument (literal 1024: no globals)
def fmha_document(b, h, q, kv, aux):
    return (aux[0][q] == aux[0][kv]) & (q >= kv)


def fmha_alibi(score, b, h, q, kv, aux):
    return score + aux[0][h] * (kv - q)


def fmha_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= 1024)


def fmha_causal(b, h, q, kv):
    return q >= kv


def flex_mods(case, doc_buf, slopes):
    """FlexAttention's (mask_mod, score_mod), closures over tensors, made once a case so that
    torch.compile reuses its graphs across S (doc_buf has the longest S; a point fills its prefix)."""
    def causal(b, h, q, kv):
        return q >= kv

    def document(b, h, q, kv):
        return (doc_buf[q] == doc_buf[kv]) & (q >= kv)

    def window(b, h, q, kv):
        return (q >= kv) & (q - kv <= 1024)

    def alibi(score, b, h, q, kv):
        return score + slopes[h] * (kv - q)
    return {"document": (document, None), "alibi": (causal, alibi), "sliding_window": (window, None),
            "causal_as_mask_mod": (causal, None)}[case]


class Skip(Exception):
    """A case an implementation cannot express: recorded as ``skipped``, not as an error."""


_FA4 = {}


def fa4_mods():
    """FA4's CuTe-DSL mods (cutlass: the device bundle only). On SM90 mask_mod(b, h, q_idx, kv_idx,
    seqlen_info, aux_tensors) gets (1,)-shaped Int32 TensorSSAs, returns a Boolean one; score_mod(score,
    b, h, q_idx=, kv_idx=, seqlen_info=, aux_tensors=) the scaled fp32 score; its backward score_mod_bwd."""
    global cutlass, cute, utils  # module globals, as in FA4's own mod definitions (the DSL reads them)
    if _FA4:
        return _FA4
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def causal(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return kv_idx <= q_idx

    @cute.jit
    def window(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= cute.full_like(q_idx, 1024))

    @cute.jit
    def document(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        doc = aux_tensors[0]  # int32 (S,): one document layout for every batch row and head
        q_doc = utils.scalar_to_ssa(doc[q_idx[0]], cutlass.Int32)
        kv_doc = utils.scalar_to_ssa(doc[kv_idx[0]], cutlass.Int32)
        return (q_doc == kv_doc) & (kv_idx <= q_idx)

    @cute.jit
    def alibi(score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        slopes = aux_tensors[0]  # fp32 (H,)
        h_frag = cute.make_rmem_tensor(1, cutlass.Int32)
        h_frag.store(h)
        slope = cute.make_rmem_tensor(1, slopes.element_type)
        slope[0] = slopes[h_frag[0]]
        return score + slope.load().to(cutlass.Float32) * (kv_idx - q_idx).to(cutlass.Float32)
    alibi.__vec_size__ = 1  # one element a call: the slope load above is scalar

    @cute.jit
    def alibi_bwd(grad, score, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad  # an additive bias: d(score + bias)/d(score) = 1
    _FA4.update(causal=causal, window=window, document=document, alibi=alibi, alibi_bwd=alibi_bwd)
    return _FA4


def documents(s):
    """Seeded random lengths of N_DOCS documents filling s positions (each at least 1)."""
    g = torch.Generator().manual_seed(1000 + s)
    cuts = (torch.randperm(s - 1, generator=g)[:N_DOCS - 1] + 1).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([s])]).diff()


def kept_pairs(case, s, lengths) -> int:
    """Pairs one (batch row, head) keeps."""
    if case == "document":
        return int((lengths * (lengths + 1) // 2).sum())
    if case == "sliding_window":
        return int((torch.arange(s).clamp(max=WINDOW) + 1).sum())
    return s * (s + 1) // 2


def reference(case, q, k, v, dout, doc, slopes):
    """fp32 output and dQ of the slice (last batch row, CHECK_HEADS, the first and last EDGE rows),
    (heads, rows, D), from plain softmax math over all keys."""
    s = q.shape[1]
    rows = torch.cat([torch.arange(EDGE), torch.arange(s - EDGE, s)]).to(q.device)
    hs = list(CHECK_HEADS)
    qr, dor = (x[-1, rows][:, hs].float().transpose(0, 1) for x in (q, dout))
    kk, vv = (x[-1][:, hs].float().transpose(0, 1) for x in (k, v))
    r, c = rows[:, None], torch.arange(s, device=q.device)[None, :]
    keep = c <= r
    if case == "document":
        keep &= doc[r] == doc[c]
    if case == "sliding_window":
        keep &= r - c <= WINDOW
    scale = D ** -0.5
    sc = qr @ kk.transpose(1, 2) * scale
    if case == "alibi":
        sc = sc + slopes[hs].float()[:, None, None] * (c - r)
    p = torch.softmax(sc.masked_fill(~keep, float("-inf")), dim=-1)
    o = p @ vv
    ds = p * (dor @ vv.transpose(1, 2) - (dor * o).sum(-1, keepdim=True))
    return rows, o, ds @ kk * scale


def rel_l2(x, rows, ref):
    x = x[-1, rows][:, list(CHECK_HEADS)].float().transpose(0, 1)
    return float(f"{float((x - ref).norm() / ref.norm()):.3g}")


def timed_build(build):
    """A block mask and its build time in ms: the second of two builds (the first compiles)."""
    build()
    torch.cuda.synchronize()
    t = time.perf_counter()
    mask = build()
    torch.cuda.synchronize()
    return mask, round((time.perf_counter() - t) * 1e3, 2)


_FLEX = {}


def flex_compiled(mode):
    if mode not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX[mode] = torch.compile(flex_attention, dynamic={"true": True, "false": False, "auto": None}[mode])
    return _FLEX[mode]


def builders(case, s, b, doc, slopes, lengths, flex_pair, flex_state):
    """impl -> () -> (call(q, k, v) -> BSHD out, build_ms, note); build_ms None: no block mask."""
    from torch.nn.attention.flex_attention import create_block_mask as flex_block_mask
    mask_mod, score_mod = flex_pair
    ckw = {"_compile": True} if "_compile" in inspect.signature(flex_block_mask).parameters else {}
    flex_bm = {}

    def flex_mask():  # shared by flex and fa4
        if not flex_bm:
            flex_bm["m"], flex_bm["ms"] = timed_build(
                lambda: flex_block_mask(mask_mod, None, None, s, s, device="cuda", BLOCK_SIZE=128, **ckw))
        return flex_bm["m"], flex_bm["ms"]
    cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths.repeat(b), 0)]).to(
        device="cuda", dtype=torch.int32)
    m = int(lengths.max())

    def fmha_impl():
        fm, aux = {"document": (fmha_document, (doc,)), "alibi": (fmha_causal, None),
                   "sliding_window": (fmha_window, None), "causal_as_mask_mod": (fmha_causal, None)}[case]
        if case == "alibi":  # built-in causal + the score_mod, no block mask
            return (lambda q, k, v: fmha.attention(q, k, v, causal=True, score_mod=fmha_alibi, aux=(slopes,)),
                    None, "causal=True + score_mod")
        bm, ms = timed_build(lambda: fmha.create_block_mask(fm, None, None, s, s, device="cuda",
                                                            BLOCK_SIZE=128, aux=aux))
        kw = dict(aux=aux) if aux else {}
        return lambda q, k, v: fmha.attention(q, k, v, mask_mod=fm, block_mask=bm, **kw), ms, "mask_mod + block_mask"

    def flex_impl():
        bm, ms = flex_mask()
        kw = dict(score_mod=score_mod) if score_mod else {}

        def call(q, k, v):
            o = flex_compiled(flex_state["mode"])(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=bm, **kw)
            return o.transpose(1, 2)
        return call, ms, f"torch.compile(dynamic={flex_state['mode']})"

    def fa4_impl():
        from flash_attn.cute import flash_attn_func
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        mods = fa4_mods()
        if case == "alibi":
            return (lambda q, k, v: flash_attn_func(q, k, v, causal=True, score_mod=mods["alibi"],
                                                    score_mod_bwd=mods["alibi_bwd"], aux_tensors=[slopes])[0],
                    None, "causal=True + score_mod")
        bm, ms = flex_mask()
        fwd = BlockSparseTensorsTorch(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                      block_size=(128, 128))
        bwd = BlockSparseTensorsTorch(bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices,
                                      block_size=(128, 128))
        fm = mods[{"document": "document", "sliding_window": "window", "causal_as_mask_mod": "causal"}[case]]
        aux = [doc] if case == "document" else None
        return (lambda q, k, v: flash_attn_func(q, k, v, mask_mod=fm, aux_tensors=aux, block_sparse_tensors=fwd,
                                                block_sparse_tensors_bwd=bwd)[0],
                ms, "mask_mod + FlexAttention's block mask as BlockSparseTensorsTorch")

    def builtin(lib):  # the same mask through the library's own options: causal, window_size, varlen
        if case == "alibi":
            raise Skip("no built-in ALiBi")
        if lib == "fmha":
            dense, varlen = fmha.attention, fmha.attention_varlen
        else:
            from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
            dense = lambda *a, **kw: flash_attn_func(*a, **kw)[0]  # noqa: E731
            varlen = lambda q, k, v, cq, ck, **kw: flash_attn_varlen_func(  # noqa: E731
                q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)[0]
        if case == "document":
            return (lambda q, k, v: varlen(*(x.view(-1, H, D) for x in (q, k, v)), cu, cu, max_seqlen_q=m,
                                           max_seqlen_k=m, causal=True).view(b, s, H, D),
                    None, "varlen, causal per document")
        kw = dict(causal=True, window_size=(WINDOW, 0)) if case == "sliding_window" else dict(causal=True)
        return lambda q, k, v: dense(q, k, v, **kw), None, str(kw)

    return dict(fmha=fmha_impl, fmha_builtin=lambda: builtin("fmha"), flex=flex_impl, fa4=fa4_impl,
                fa4_builtin=lambda: builtin("fa4"))


def measure(row, call, direction, q, k, v, dout, ref, flops, rep):
    rows, o_ref, dq_ref = ref
    grad = direction != "fwd"
    leaves = [x.detach().requires_grad_(grad) for x in (q, k, v)]

    def step():  # autograd.grad: all three gradients, fresh (no accumulation kernel in the timing)
        out = call(*leaves)
        return out, torch.autograd.grad(out, leaves, dout)[0] if grad else None
    t = time.perf_counter()
    with torch.set_grad_enabled(grad):
        out, dq = step()
        torch.cuda.synchronize()
        row["first_s"] = round(time.perf_counter() - t, 2)
        row["err"] = rel_l2(out.detach(), rows, o_ref)
        if grad:
            row["err_dq"] = rel_l2(dq, rows, dq_ref)
        del out, dq
        sec = seconds_per_call(step, rep)
    row["ms"] = round(sec * 1e3, 4)
    row["tflops"] = round(flops / sec / 1e12, 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="")
    ap.add_argument("--backward", action="store_true", help="also time forward+backward (autograd)")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--seqlens", default="4096,8192,16384,32768")
    ap.add_argument("--impls", default="fmha,fmha_builtin,flex,fa4",
                    help="of " + ",".join(IMPLS) + " (fa4_builtin: six more FA4 compiles)")
    ap.add_argument("--rep", type=int, default=30, help="ms of timed calls a point (do_bench rep)")
    ap.add_argument("--flex-dynamic", default="true", choices=("true", "false", "auto"),
                    help="torch.compile(dynamic=) for flex: true compiles once per mod across S; a failure "
                         "falls back to false")
    ap.add_argument("--budget-s", type=float, default=450,
                    help="points that would start later than this are recorded as skipped (0: no limit)")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="_compile flag")  # torch's nudge to torch.compile(create_block_mask)
    cases, impls = args.cases.split(","), args.impls.split(",")
    seqlens = [int(x) for x in args.seqlens.split(",")]
    assert set(cases) <= set(CASES) and set(impls) <= set(IMPLS), (cases, impls)
    # one graph per (mod, grad mode, [static S]) for flex: past the default limit of 8
    import torch._dynamo
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    rows, t_start = [], time.perf_counter()
    meta = dict(torch=torch.__version__, fmha=os.path.dirname(os.path.abspath(fmha.__file__)))
    for pkg in ("triton", "flash-attn-4", "nvidia-cutlass-dsl"):
        try:
            meta[pkg] = version(pkg)
        except Exception as e:  # not installed here: its rows will say so
            meta[pkg] = f"n/a ({type(e).__name__})"
    keep_row(rows, dict(meta=meta), args.out)
    directions = ["fwd"] + (["fwd+bwd"] if args.backward else [])
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda", dtype=torch.float32)
    for case in cases:
        doc_buf = torch.zeros(max(seqlens), dtype=torch.int32, device="cuda")
        flex_pair = flex_mods(case, doc_buf, slopes)
        flex_state = {"mode": args.flex_dynamic}
        for s in seqlens:
            b = TOKENS // s
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                for impl in impls:
                    for direction in directions:
                        keep_row(rows, dict(case=case, S=s, B=b, impl=impl, direction=direction,
                                            skipped=f"past --budget-s {args.budget_s:g}"), args.out)
                continue
            lengths = documents(s)
            doc = doc_buf[:s]
            doc.copy_(torch.repeat_interleave(torch.arange(N_DOCS, dtype=torch.int32), lengths))
            g = torch.Generator(device="cuda").manual_seed(s)
            q, k, v, dout = (torch.randn(b, s, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))
            kept = kept_pairs(case, s, lengths)
            ref = reference(case, q, k, v, dout, doc, slopes)
            build = builders(case, s, b, doc, slopes, lengths, flex_pair, flex_state)
            for impl in impls:
                base = dict(case=case, S=s, B=b, impl=impl, kept_frac=round(kept / (s * s), 4))
                try:
                    call, build_ms, note = build[impl]()
                    base.update(build_ms=build_ms, note=note)
                except Exception as e:
                    why = dict(skipped=str(e)) if isinstance(e, Skip) else dict(error=f"{type(e).__name__}: {e}"[:400])
                    for direction in directions:
                        keep_row(rows, dict(base, direction=direction, **why), args.out)
                    continue
                for direction in directions:
                    row = dict(base, direction=direction)
                    flops = (4 if direction == "fwd" else 14) * b * H * D * kept
                    try:
                        try:
                            measure(row, call, direction, q, k, v, dout, ref, flops, args.rep)
                        except Exception as e:
                            if impl != "flex" or flex_state["mode"] == "false":
                                raise
                            flex_state["mode"] = "false"  # dynamic shapes failed: static graphs from here on
                            row["note"] = f"torch.compile(dynamic=False) after: {type(e).__name__}: {e}"[:400]
                            measure(row, call, direction, q, k, v, dout, ref, flops, args.rep)
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"[:400]
                    row["elapsed_s"] = round(time.perf_counter() - t_start, 1)
                    keep_row(rows, row, args.out)
                    torch.cuda.empty_cache()
            del q, k, v, dout, ref, build
        del doc_buf, flex_pair
        gc.collect()
        torch.cuda.empty_cache()
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
