"""Programmable attention on the Hopper kernels (``backend="kernel"``, no fallback) against the
fp64 reference running the same callables: score mods (ALiBi with an aux tensor, a softcap
written as a mod, a relative bias read from a captured tensor), mask mods (document masks from a
captured tensor, a window written as a mod, on top of a built-in causal mask), block masks
(``fmha.create_block_mask`` and a FlexAttention ``BlockMask``), dense and varlen (empty and
length-1 sequences), GQA, forward and backward. Outputs and gradients are poisoned with NaN first.
Marked ``gpu``; skipped without a Hopper GPU."""

import math

import pytest
import torch

import fmha
from fmha import mods as M
from fmha.mods import call_mods
from fmha.options import parse
from fmha.reference import attention_backward_reference, attention_reference
from gpu_checks import cu_seqlens, lse_max_err, rel_l2

pytestmark = pytest.mark.gpu
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_needs_hopper = pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (SM90) GPU")

S_Q, S_K, H_Q, H_K = 333, 301, 8, 2
DOCS = None  # document ids of the positions, captured by the document mask (set per test)
BIAS = None  # (H_Q, 64) relative-position bias table, captured by ``rel_bias``


def alibi(score, b, h, q, kv, aux):
    return score + aux[0][h] * (kv - q)


def cap(score, b, h, q, kv):
    return 20.0 * M.tanh(score / 20.0)


def rel_bias(score, b, h, q, kv):
    return score + BIAS[h, M.minimum(M.abs(q - kv), 63)]


def doc_mask(b, h, q, kv):
    return DOCS[q] == DOCS[kv]


def window_mask(b, h, q, kv):
    return (q - kv <= 40) & (kv - q <= 40)


CASES = {  # name: (score_mod, mask_mod, built-in options, block mask?)
    "alibi_causal": (alibi, None, dict(causal=True), False),
    "cap": (cap, None, dict(), False),
    "rel_bias_window": (rel_bias, window_mask, dict(), False),
    "doc": (None, doc_mask, dict(), False),
    "doc_causal_builtin": (None, doc_mask, dict(causal=True), False),
    "doc_block": (None, doc_mask, dict(), True),
    "alibi_doc_block": (alibi, doc_mask, dict(), True),
    "window_block": (None, window_mask, dict(), True),
}


def _setup(gen, s):
    global DOCS, BIAS
    DOCS = torch.randint(0, 6, (s,), generator=gen, device="cuda").sort().values.to(torch.int32)
    BIAS = torch.randn(H_Q, 64, generator=gen, device="cuda")
    return (torch.tensor([2 ** (-8 * (i + 1) / H_Q) for i in range(H_Q)], device="cuda"),)


def _reference_mods(score_mod, mask_mod, aux, block_mask):
    return call_mods(parse(score_mod=score_mod, mask_mod=mask_mod), aux if (
        score_mod is alibi) else None, block_mask)


@_needs_hopper
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("d", [64, 128])
def test_forward_dense(case, d):
    score_mod, mask_mod, builtin, blocked = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(d + len(case))
    aux = _setup(gen, max(S_Q, S_K))
    q = torch.randn(2, S_Q, H_Q, d, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, S_K, H_K, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    bm = fmha.create_block_mask(mask_mod, None, None, S_Q, S_K, BLOCK_SIZE=64) if blocked else None
    kw = dict(builtin, score_mod=score_mod, mask_mod=mask_mod, aux=aux if score_mod is alibi else None,
              block_mask=bm)
    out = torch.full((2, S_Q, H_Q, d), math.nan, dtype=torch.bfloat16, device="cuda")
    lse = torch.full((2, H_Q, S_Q), math.nan, device="cuda")
    fmha.attention(q, k, v, out=out, lse=lse, backend="kernel", **kw)
    mods = _reference_mods(score_mod, mask_mod, aux, bm)
    ref_o, ref_lse = attention_reference(q, k, v, mask=parse(**builtin).mask, compute_dtype=torch.float64,
                                         mods=mods)
    assert rel_l2(out, ref_o) < 1e-2
    assert lse_max_err(lse, ref_lse) < 1e-2


@_needs_hopper
@pytest.mark.parametrize("case", ["alibi_causal", "rel_bias_window", "doc", "doc_causal_builtin", "cap"])
def test_forward_varlen_empty_and_length_one_sequences(case):
    score_mod, mask_mod, builtin, _ = CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(7 + len(case))
    aux = _setup(gen, 400)
    lens_q, lens_k = [130, 0, 1, 257, 64], [90, 3, 1, 300, 0]
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q = torch.randn(sum(lens_q), H_Q, 128, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), H_K, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    kw = dict(builtin, score_mod=score_mod, mask_mod=mask_mod, aux=aux if score_mod is alibi else None)
    out = torch.full(q.shape, math.nan, dtype=torch.bfloat16, device="cuda")
    o = fmha.attention_varlen(q, k, v, cu_q, cu_k, out=out, backend="kernel", **kw)
    ref_o, _ = attention_reference(q, k, v, cu_q, cu_k, mask=parse(**builtin).mask, compute_dtype=torch.float64,
                                   mods=_reference_mods(score_mod, mask_mod, aux, None))
    assert rel_l2(o, ref_o) < 1e-2


BACKWARD = ["alibi_causal", "cap", "rel_bias_window", "doc", "doc_block", "alibi_doc_block", "window_block"]


@_needs_hopper
@pytest.mark.parametrize("case", BACKWARD)
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_backward(case, layout):
    score_mod, mask_mod, builtin, blocked = CASES[case]
    if blocked and layout == "varlen":
        pytest.skip("block masks are for dense batches (validation refuses varlen: test_mods.py)")
    gen = torch.Generator(device="cuda").manual_seed(11 + len(case))
    aux = _setup(gen, 400)
    d = 128
    if layout == "dense":
        q = torch.randn(2, S_Q, H_Q, d, generator=gen, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(2, S_K, H_K, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
        cu_q = cu_k = None
        bm = fmha.create_block_mask(mask_mod, None, None, S_Q, S_K, BLOCK_SIZE=128) if blocked else None
    else:
        lens_q, lens_k = [130, 0, 1, 257], [90, 3, 1, 300]
        cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
        q = torch.randn(sum(lens_q), H_Q, d, generator=gen, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(sum(lens_k), H_K, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
        bm = None
    kw = dict(builtin, score_mod=score_mod, mask_mod=mask_mod, aux=aux if score_mod is alibi else None)
    if layout == "dense":
        o, lse = fmha.attention(q, k, v, return_lse=True, backend="kernel", block_mask=bm, **kw)
    else:
        o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend="kernel", **kw)
    dout = torch.randn(o.shape, generator=gen, device="cuda").to(torch.bfloat16)
    grads = [torch.full_like(t, math.nan) for t in (q, k, v)]
    got = fmha.attention_backward(dout, q, k, v, o, lse, cu_q, cu_k, dq=grads[0], dk=grads[1], dv=grads[2],
                                  backend="kernel", block_mask=bm, **kw)
    mods = _reference_mods(score_mod, mask_mod, aux, bm)
    mask = parse(**builtin).mask
    ref_o, ref_lse = attention_reference(q, k, v, cu_q, cu_k, mask=mask, compute_dtype=torch.float64, mods=mods)
    want = attention_backward_reference(dout, q, k, v, ref_o, ref_lse, cu_q, cu_k, mask=mask,
                                        compute_dtype=torch.float64, mods=mods)
    for name, g, w in zip("qkv", got, want):
        assert rel_l2(g, w) < 2e-2, name


@_needs_hopper
def test_flex_attention_block_mask_matches_flex_attention():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, h, s, d = 2, 4, 1000, 128
    docs = torch.randint(0, 5, (s,), generator=gen, device="cuda").sort().values

    def doc_causal(bi, hi, qi, kv):
        return (docs[qi] == docs[kv]) & (qi >= kv)

    def bias(score, bi, hi, qi, kv):
        return score + (hi + 1) * 0.05 * (kv - qi)

    q, k, v = (torch.randn(b, h, s, d, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(3))
    fbm = flex.create_block_mask(doc_causal, None, None, s, s, device="cuda")
    want = flex.flex_attention(q, k, v, score_mod=bias, block_mask=fbm)
    got = fmha.attention(*(t.transpose(1, 2) for t in (q, k, v)), score_mod=bias, block_mask=fbm, backend="kernel")
    ref, _ = attention_reference(*(t.transpose(1, 2) for t in (q, k, v)), compute_dtype=torch.float64,
                                 mods=call_mods(parse(score_mod=bias), None, fbm))
    assert rel_l2(got, ref) < 1e-2
    assert rel_l2(got.transpose(1, 2), want.double()) < 1e-2


@_needs_hopper
def test_block_mask_tiles_claimed_longest_first_on_a_long_problem():
    """K/V beyond half the L2: the forward claims a block mask's query tiles (as it does causal
    ones); every tile is still computed once, and the backward agrees."""
    from fmha.kernels.hopper.config import HopperForwardConfig, Schedule
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    gen = torch.Generator(device="cuda").manual_seed(11)
    b, s, h, d = 2, 4099, 16, 128
    _setup(gen, s)  # the document ids doc_mask reads
    q, k, v = (torch.randn(b, s, h, d, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    bm = fmha.create_block_mask(doc_mask, None, None, s, s)
    problem = validate(q, k, v, options=parse(mask_mod=doc_mask), mods=call_mods(parse(mask_mod=doc_mask), None, bm))
    assert HopperForwardConfig.from_problem(problem, KernelOptions()).schedule == Schedule.CLAIMED
    out = fmha.attention(q, k, v, block_mask=bm, backend="kernel")
    dout = torch.randn_like(out)
    out.backward(dout)
    mods = call_mods(parse(mask_mod=doc_mask), None, bm)
    ref_o, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), compute_dtype=torch.float64, mods=mods)
    assert rel_l2(out, ref_o) < 1e-2
    want = attention_backward_reference(dout, q.detach(), k.detach(), v.detach(), ref_o, ref_lse,
                                        compute_dtype=torch.float64, mods=mods)
    for name, t, w in zip("qkv", (q, k, v), want):
        assert rel_l2(t.grad, w) < 2e-2, name


@_needs_hopper
def test_fused_attention_runs_the_mods_it_is_built_with():
    """``FusedAttention`` with a score mod, an aux tensor and a block mask: each execution
    (checked and unchecked) gives ``fmha.attention``'s output bitwise, and reads the aux tensor
    as it is at that execution."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    aux = _setup(gen, S_K)
    q = torch.randn(2, S_Q, H_Q, 64, generator=gen, device="cuda").to(torch.bfloat16)
    k, v = (torch.randn(2, S_K, H_K, 64, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    bm = fmha.create_block_mask(window_mask, None, None, S_Q, S_K, BLOCK_SIZE=64)
    out = torch.full((2, S_Q, H_Q, 64), math.nan, dtype=torch.bfloat16, device="cuda")
    fa = fmha.FusedAttention(q, k, v, out, score_mod=alibi, aux=aux, block_mask=bm, backend="kernel")
    fa.execute(q, k, v, out)
    want = fmha.attention(q, k, v, score_mod=alibi, aux=aux, block_mask=bm, backend="kernel")
    assert torch.equal(out, want)
    aux[0].mul_(2.0)  # the same tensor, new values
    out.fill_(math.nan)
    fa.execute(q, k, v, out, check=False)
    assert torch.equal(out, fmha.attention(q, k, v, score_mod=alibi, aux=aux, block_mask=bm, backend="kernel"))
    assert not torch.equal(out, want)


@_needs_hopper
def test_mods_under_torch_compile_run_the_same_kernels():
    """``torch.compile(fullgraph=True)`` of a call with ALiBi (aux) and a document block mask:
    the output equals the eager kernel call's bitwise, the gradients up to the backward's
    atomic accumulation order."""
    torch._dynamo.reset()
    gen = torch.Generator(device="cuda").manual_seed(8)
    aux = _setup(gen, S_Q)
    bm = fmha.create_block_mask(doc_mask, None, None, S_Q, S_Q)

    def call(q, k, v):
        return fmha.attention(q, k, v, score_mod=alibi, aux=aux, block_mask=bm, backend="kernel")

    base = [torch.randn(2, S_Q, H_Q if i == 0 else H_K, 128, generator=gen, device="cuda").to(torch.bfloat16)
            for i in range(3)]
    leaves, eager_leaves = ([t.clone().requires_grad_() for t in base] for _ in range(2))
    got = torch.compile(call, fullgraph=True)(*leaves)
    want = call(*eager_leaves)
    assert torch.equal(got, want)
    dout = torch.randn_like(want)
    got.backward(dout)
    want.backward(dout)
    for a, b in zip(leaves, eager_leaves):
        assert rel_l2(a.grad, b.grad) < 1e-3


@_needs_hopper
def test_learnable_aux_tensors_get_gradients_beside_the_kernels():
    """A relative-position bias table passed as ``aux`` and trained: the kernels' dq/dk/dv and
    the table's gradient (the reference's pass through the mod) against fp64 autograd."""
    from fmha.reference import aux_gradients

    gen = torch.Generator(device="cuda").manual_seed(12)
    table = torch.randn(H_Q, 64, generator=gen, device="cuda").requires_grad_()

    def learned_bias(score, b, h, q, kv, aux):
        return score + aux[0][h, M.minimum(M.abs(q - kv), 63)]

    q = torch.randn(2, S_Q, H_Q, 64, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    k, v = (torch.randn(2, S_K, H_K, 64, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
            for _ in range(2))
    out = fmha.attention(q, k, v, causal=True, score_mod=learned_bias, aux=(table,), backend="kernel")
    dout = torch.randn_like(out)
    out.backward(dout)
    mods = call_mods(parse(score_mod=learned_bias), (table.detach(),))
    mask = parse(causal=True).mask
    ref_o, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), mask=mask, compute_dtype=torch.float64,
                                         mods=mods)
    want = attention_backward_reference(dout, q.detach(), k.detach(), v.detach(), ref_o, ref_lse, mask=mask,
                                        compute_dtype=torch.float64, mods=mods)
    for name, t, w in zip("qkv", (q, k, v), want):
        assert rel_l2(t.grad, w) < 2e-2, name
    want_table = aux_gradients(dout.double(), q.detach().double(), k.detach().double(), v.detach().double(),
                               ref_o.double(), ref_lse.double(), mods=call_mods(parse(score_mod=learned_bias),
                                                                                (table.detach().double(),)),
                               needs=[True], mask=mask)[0]
    assert rel_l2(table.grad, want_table) < 2e-2
