"""The backward on the CPU: the reference backward against autograd through a naive fp64
attention (every mask, GQA, varlen with empty and length-1 sequences, scales, a gradient on the
LSE), ``gradcheck`` in fp64, the differentiable public API against the error of a bf16
computation done the usual way, the functional ``attention_backward``, its argument checks, and
a small model trained under ``torch.compile(fullgraph=True)`` against SDPA."""

import dataclasses
import itertools
import math

import pytest
import torch

import fmha
from fmha.masking import MaskSpec
from attention_model import train_losses
from fmha.reference import attention_backward_reference, attention_reference
from naive import keep_matrix, naive_mask

MASKS = [dict(), dict(causal=True), dict(causal=True, mask_align="bottom_right"),
         dict(window_size=(5, 3)), dict(window_size=(None, 4), mask_align="bottom_right"),
         dict(window_size=(6, None)), dict(compressed_causal=True)]
SCALES = dict(softmax_scale=0.21, scale_q=1.5, scale_k=0.5, scale_v=2.0, inv_scale_o=0.75)


def differentiable_naive(q, k, v, mask_kwargs, cu=None, softmax_scale=None, scale_q=1.0, scale_k=1.0,
                         scale_v=1.0, inv_scale_o=1.0):
    """O and LSE as plain torch ops that autograd differentiates: the full score matrix per
    sequence, the mask as the semantics' predicate, empty rows O = 0 and LSE -inf."""
    d = q.shape[-1]
    ss = (1 / math.sqrt(d) if softmax_scale is None else softmax_scale) * scale_q * scale_k
    mask = naive_mask(**mask_kwargs)

    def one(qs, ks, vs):
        sq, hq, _ = qs.shape
        sk, hk, _ = ks.shape
        g = hq // hk
        kk, vv = ks.repeat_interleave(g, 1), vs.repeat_interleave(g, 1)
        s = torch.einsum("qhd,khd->hqk", qs, kk) * ss
        keep = keep_matrix(sq, sk, mask) if sq and sk else torch.zeros(sq, sk, dtype=torch.bool)
        s = s.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(s, -1) if sk else s.new_full((hq, sq), -math.inf)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
        return torch.einsum("hqk,khd->qhd", p, vv) * scale_v * inv_scale_o, lse

    if cu is None:
        outs = [one(q[b], k[b], v[b]) for b in range(q.shape[0])]
        return torch.stack([o for o, _ in outs]), torch.stack([lse for _, lse in outs])
    cq, ck = cu
    outs = [one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]) for b in range(len(cq) - 1)]
    return torch.cat([o for o, _ in outs]), torch.cat([lse for _, lse in outs], dim=1)


def _inputs(varlen, mask_kwargs, dtype=torch.float64, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    compressed = mask_kwargs.get("compressed_causal")
    if varlen:
        lens_q = [12, 0, 1, 9, 20] if compressed else [13, 0, 1, 9, 4]
        lens_k = [4, 0, 1, 3, 5] if compressed else [11, 3, 1, 0, 7]
        shapes = (sum(lens_q), 4, d), (sum(lens_k), 2, d)
        cu = ([0, *itertools.accumulate(lens_q)], [0, *itertools.accumulate(lens_k)])
    else:
        sq, sk = (21, 7) if compressed else (13, 11)
        shapes = (2, sq, 4, d), (2, sk, 2, d)
        cu = None
    q = torch.randn(*shapes[0], generator=g, dtype=torch.float64).to(dtype)
    k, v = (torch.randn(*shapes[1], generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v, cu


def _cu_tensors(cu):
    return (None, None) if cu is None else tuple(torch.tensor(c, dtype=torch.int32) for c in cu)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("mask_kwargs", MASKS, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "none")
def test_reference_backward_matches_autograd_of_the_naive_attention(varlen, mask_kwargs):
    q, k, v, cu = _inputs(varlen, mask_kwargs)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = differentiable_naive(q, k, v, mask_kwargs, cu, **SCALES)
    g = torch.Generator().manual_seed(1)
    do = torch.randn(o.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64).masked_fill(torch.isneginf(lse), 0)
    ((o * do).sum() + (lse.masked_fill(torch.isneginf(lse), 0) * dlse).sum()).backward()
    cu_q, cu_k = _cu_tensors(cu)
    mask = MaskSpec.from_args(**mask_kwargs)
    out, ref_lse = attention_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, mask=mask,
                                       compute_dtype=torch.float64, **SCALES)
    grads = attention_backward_reference(do, q.detach(), k.detach(), v.detach(), out, ref_lse, cu_q, cu_k, mask=mask,
                                         dlse=dlse, compute_dtype=torch.float64, **SCALES)
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


class _ReferenceAttention(torch.autograd.Function):
    """The reference forward with the reference backward, for gradcheck."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        o, lse = attention_reference(q, k, v, mask=mask, compute_dtype=torch.float64)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask = mask
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = attention_backward_reference(do, q, k, v, o, lse, mask=ctx.mask, dlse=dlse,
                                             compute_dtype=torch.float64)
        return (*grads, None)


@pytest.mark.parametrize("mask_kwargs", [dict(), dict(causal=True, mask_align="bottom_right"),
                                         dict(window_size=(2, 1))])
def test_reference_backward_passes_gradcheck(mask_kwargs):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 5, 2, 32, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 6, 1, 32, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 6, 1, 32, generator=g, dtype=torch.float64, requires_grad=True)
    mask = MaskSpec.from_args(**mask_kwargs)
    assert torch.autograd.gradcheck(lambda *t: _ReferenceAttention.apply(*t, mask), (q, k, v))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("mask_kwargs", [dict(), dict(causal=True), dict(window_size=(4, 0), mask_align="bottom_right"),
                                         dict(compressed_causal=True)], ids=str)
def test_differentiable_api_within_twice_the_error_of_a_bf16_computation(varlen, mask_kwargs):
    """fmha's bf16 gradients against fp64, judged as FlashAttention's tests do: at most about
    twice the error of the same attention computed in bf16 with plain torch ops."""
    q64, k64, v64, cu = _inputs(varlen, mask_kwargs, d=64, seed=5)
    do64 = torch.randn(q64.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    exact = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    o, _ = differentiable_naive(*exact, mask_kwargs, cu)
    (o * do64).sum().backward()
    low = [t.to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64)]
    o, _ = differentiable_naive(*low, mask_kwargs, cu)
    (o * do64.to(torch.bfloat16)).sum().backward()
    ours = [t.to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64)]
    cu_q, cu_k = _cu_tensors(cu)
    if varlen:
        o = fmha.attention_varlen(*ours, cu_q, cu_k, **mask_kwargs)
    else:
        o = fmha.attention(*ours, **mask_kwargs)
    assert o.grad_fn is not None
    (o.double() * do64).sum().backward()
    for name, e, lo, us in zip("qkv", exact, low, ours):
        ref_err = (lo.grad.double() - e.grad).norm()
        our_err = (us.grad.double() - e.grad).norm()
        assert our_err <= 2 * ref_err + 1e-6 * e.grad.norm(), (name, our_err.item(), ref_err.item())


def test_functional_backward_gives_what_autograd_gives_and_writes_given_outputs():
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    do = torch.randn_like(o)
    o.backward(do)
    dq = torch.full_like(q, float("nan"))
    got = fmha.attention_backward(do, q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), causal=True,
                                  dq=dq)
    assert got[0] is dq
    for a, b in zip(got, (q.grad, k.grad, v.grad)):
        assert torch.equal(a, b)


def test_a_gradient_on_the_lse_reaches_q_and_k():
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=64)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    _, lse = fmha.attention(q, k, v, return_lse=True)
    lse.sum().backward()
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    differentiable_naive(*exact, {})[1].sum().backward()
    for ours, e in zip((q, k), exact[:2]):
        assert (ours.grad.double() - e.grad).norm() <= 1e-2 * e.grad.norm()
    assert not v.grad.any()  # the LSE does not depend on V


def test_deterministic_reaches_the_backend_choice(monkeypatch):
    """``deterministic=True`` is part of what the backward's backend is chosen by (the Hopper
    kernel builds an ordered-dQ kernel for it), from the functional backward and from autograd."""
    from fmha import backends, dispatch

    seen = []

    def spy(kind, backend, problem, options):
        if kind is backends.BACKWARD:
            seen.append(options.deterministic)
        return backends.REFERENCE

    monkeypatch.setattr(dispatch, "select", spy)
    backends.clear_cache()  # calls remembered by earlier tests would not reach the spy
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=64)
    o, lse = fmha.attention(q, k, v, return_lse=True)
    for flag in (False, True):
        fmha.attention_backward(o, q, k, v, o, lse, deterministic=flag)
    assert seen == [False, True]
    with pytest.raises(TypeError, match="deterministic"):
        fmha.attention_backward(o, q, k, v, o, lse, deterministic=1)
    backends.clear_cache()  # autograd's backward calls share the functional calls' memo entries
    for flag in (False, True):
        qg = q.detach().requires_grad_(True)
        fmha.attention(qg, k, v, deterministic=flag).sum().backward()
        assert qg.grad is not None
    assert seen == [False, True, False, True]
    with pytest.raises(TypeError, match="deterministic"):
        fmha.attention(q.detach().requires_grad_(True), k, v, deterministic="yes")


def test_the_hopper_backward_refuses_what_it_does_not_serve():
    pytest.importorskip("cutlass")
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig, why_unsupported_backward
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=64)
    problem = validate(q, k, v)
    assert why_unsupported_backward(problem, KernelOptions()) == []
    assert why_unsupported_backward(problem, KernelOptions(deterministic=True)) == []
    assert HopperBackwardConfig.from_problem(problem, KernelOptions(deterministic=True)).deterministic
    q256 = torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16)
    d256 = validate(q256, q256, q256)
    assert why_unsupported_backward(d256, KernelOptions()) == []  # with the head dim split (its own test)
    assert HopperBackwardConfig.from_problem(d256).split_head_dim
    for d, dv in ((96, 96), (192, 192), (192, 128), (128, 64)):  # multiples of 32 (halves of whole MMA steps)
        assert why_unsupported_backward(dataclasses.replace(problem, head_dim=d, head_dim_v=dv), KernelOptions()) == []
    for d, dv, split in ((192, 192, True), (192, 128, True), (128, 128, False), (128, 64, False), (160, 96, False)):
        cfg = HopperBackwardConfig.from_problem(dataclasses.replace(problem, head_dim=d, head_dim_v=dv))
        assert (cfg.head_dim_v, cfg.split_head_dim) == (dv, split)
    for d, dv in ((80, 80), (192, 80), (288, 288)):
        assert "head dims" in why_unsupported_backward(dataclasses.replace(problem, head_dim=d, head_dim_v=dv),
                                                       KernelOptions())[0]
    cu = torch.tensor([0, 8], dtype=torch.int32)
    varlen = validate(q256[0, :, :, :64].contiguous(), q256[0, :, :, :64].contiguous(),
                      q256[0, :, :, :64].contiguous(), varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert why_unsupported_backward(varlen, KernelOptions()) == []  # packed batches are served
    assert HopperBackwardConfig.from_problem(varlen).varlen and not HopperBackwardConfig.from_problem(problem).varlen


def test_the_hopper_backward_steps_over_80_rows_without_a_mask_on_long_rows():
    """D=128 without a mask from LONG_ROWS query rows (the longest sequence's, for varlen): 80 rows
    per step, dQ transposed; with a mask, shorter rows or D=64, the tiles of before; and the GPU
    check's backward cases include such configurations."""
    pytest.importorskip("cutlass")
    from fmha.kernels.hopper.bwd_config import LONG_ROWS, HopperBackwardConfig
    from fmha.validation import validate
    from gpu_cases import backward_config, build_backward_suite

    def tile(s, d=128, varlen=False, **mask):
        q = torch.zeros(1, s, 2, d, dtype=torch.bfloat16)
        if varlen:
            cu = torch.tensor([0, 1, s], dtype=torch.int32)
            problem = validate(q[0], q[0], q[0], varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, **mask)
        else:
            problem = validate(q, q, q, **mask)
        cfg = HopperBackwardConfig.from_problem(problem)
        assert cfg.dq_transposed == (cfg.tile_m == 80)
        return cfg.tile_m

    assert tile(LONG_ROWS) == 80 and tile(LONG_ROWS + 2, varlen=True) == 80
    assert tile(LONG_ROWS - 1) == 64 and tile(LONG_ROWS, varlen=True) == 64  # the longest is LONG_ROWS - 1
    assert tile(LONG_ROWS, causal=True) == 64 and tile(LONG_ROWS, d=64) == 128
    tiles = [backward_config(c, torch).tile_m for c in build_backward_suite() if c.head_dim == 128]
    assert tiles.count(80) == 3 and tiles.count(64) > 30


def test_a_causal_backward_of_few_waves_launches_its_costliest_kv_tiles_first():
    """GQA 16/2 at 2k and 8k tokens (256 K/V-tile CTAs, each walking 16 heads) takes the grid
    with the K/V tile slowest; the standard grid's MHA points (2048 CTAs), non-causal masks,
    windows bounded on the left, varlen and deterministic keep the tile-fastest order."""
    pytest.importorskip("cutlass")
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    def first(b, s, hq, hk, det=False, **mask):
        q = torch.zeros(b, s, hq, 128, dtype=torch.bfloat16, device="meta")
        k = torch.zeros(b, s, hk, 128, dtype=torch.bfloat16, device="meta")
        problem = validate(q, k, k, **mask)
        return HopperBackwardConfig.from_problem(problem, KernelOptions(deterministic=det)).kv_tiles_costliest_first

    assert first(8, 2048, 16, 2, causal=True) and first(2, 8192, 16, 2, causal=True)
    assert first(1, 300, 4, 4, compressed_causal=(32, 16)) and first(1, 4096, 8, 8, window_size=(None, 64))
    assert not first(1, 16384, 16, 16, causal=True) and not first(8, 2048, 16, 16, causal=True)
    assert not first(2, 8192, 16, 2) and not first(2, 8192, 16, 2, window_size=(256, 0))
    assert not first(2, 8192, 16, 2, det=True, causal=True)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    q = torch.zeros(300, 16, 128, dtype=torch.bfloat16)
    varlen = validate(q, q[:, :2], q[:, :2], varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    assert not HopperBackwardConfig.from_problem(varlen).kv_tiles_costliest_first


def test_backward_argument_errors():
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=64)
    o, lse = fmha.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="lse is required"):
        fmha.attention_backward(o, q, k, v, o, None)
    with pytest.raises(ValueError, match="dout has shape"):
        fmha.attention_backward(o[:, :3], q, k, v, o, lse)
    with pytest.raises(TypeError, match=r"dout has dtype float16, expected bfloat16 \(out's\)"):
        fmha.attention_backward(o.half(), q, k, v, o, lse)
    with pytest.raises(TypeError, match=r"dout has dtype bfloat16, expected float16 \(out's\)"):
        fmha.attention_backward(o, q, k, v, o.half(), lse)  # out in another dtype than dout: out's names it
    strided = torch.empty(o.shape[:-1] + (2 * o.shape[-1],), dtype=o.dtype)[..., ::2]
    with pytest.raises(ValueError, match="dout.*contiguous"):
        fmha.attention_backward(strided.copy_(o), q, k, v, o, lse)
    with pytest.raises(ValueError, match=r"dk has shape .*\(k's\)"):
        fmha.attention_backward(o, q, k, v, o, lse, dk=torch.empty_like(q))
    # gradient buffers the kernel writes in place: the inputs' layout rules, before any launch
    with pytest.raises(ValueError, match=r"dv head dim is not contiguous.*call \.contiguous\(\)"):
        fmha.attention_backward(o, q, k, v, o, lse,
                                dv=torch.empty(v.shape[:-1] + (2 * v.shape[-1],), dtype=v.dtype)[..., ::2])
    offset = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    with pytest.raises(ValueError, match=r"dq data pointer is not 16-byte aligned"):
        fmha.attention_backward(o, q, k, v, o, lse, dq=offset)
    f8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]
    o8, lse8 = fmha.attention(*f8, return_lse=True)
    with pytest.raises(TypeError, match="fp8 inputs have no backward"):
        fmha.attention_backward(o8, *f8, o8, lse8)
    with pytest.raises(fmha.UnsupportedError):
        fmha.attention_backward(o, q, k, v, o, lse, backend="kernel")
    with pytest.raises(ValueError, match="not differentiable"):
        fmha.attention(q.requires_grad_(), k, v, out=torch.empty_like(o))
    with pytest.raises(ValueError, match="window_size left must be"):
        fmha.attention(q, k, v, window_size=(1.5, 0))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_training_under_torch_compile_fullgraph_matches_sdpa(backend):
    torch._dynamo.reset()
    sdpa = train_losses(False)
    assert train_losses(True, backend) == pytest.approx(sdpa, rel=1e-4)


def test_repeated_backward_calls_skip_validation_and_dispatch(monkeypatch):
    """A training loop's backward calls repeat their metadata: the second is not validated again,
    and gives the same gradients; a call with other metadata is."""
    from fmha import backends, dispatch

    backends.clear_cache()
    q, k, v, _ = _inputs(False, {"causal": True}, dtype=torch.bfloat16, d=64)
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    calls = []
    real = dispatch.validate_backward
    monkeypatch.setattr(dispatch, "validate_backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = fmha.attention_backward(o, q, k, v, o, lse, causal=True)
    second = fmha.attention_backward(o, q, k, v, o, lse, causal=True)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(first, second))
    fmha.attention_backward(o, q, k, v, o, lse, causal=False)
    fmha.attention_backward(o, q, k, v, o, lse, causal=True, deterministic=True)
    assert len(calls) == 3


def test_eager_calls_with_autograd_skip_the_custom_op_dispatch():
    """Outside torch.compile, autograd goes through a plain autograd function (the custom ops'
    dispatch cost about 1 ms of host time per training step); under compile, the ops are traced."""
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=32)
    q.requires_grad_()
    o = fmha.attention(q, k, v, causal=True)
    assert type(o.grad_fn).__name__ == "_EagerAttentionBackward"
    o.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_double_backward_is_refused_with_a_clear_error():
    """create_graph=True works (another part of a model may need it); differentiating fmha's
    gradients again raises instead of treating them as constants."""
    q, k, v, _ = _inputs(False, {}, dtype=torch.bfloat16, d=32)
    q.requires_grad_()
    o = fmha.attention(q, k, v)
    (g,) = torch.autograd.grad(o.float().sum(), q, create_graph=True)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="no double backward"):
        g.float().sum().backward()


def test_shape_only_calls_with_autograd_take_the_ops_fake_implementations():
    """Meta and fake tensors (shape propagation, FLOP counting) go through the custom ops, whose
    fake implementations describe the outputs; the plain autograd function would run the math."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = (torch.empty(2, 9, 2, 32, dtype=torch.bfloat16, device="meta").requires_grad_() for _ in range(3))
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True)
    assert o.shape == q.shape and o.device.type == "meta" and lse.shape == (2, 2, 9)
    with FakeTensorMode():
        q = torch.empty(2, 9, 2, 32, dtype=torch.bfloat16).requires_grad_()
        assert fmha.attention(q, q, q).shape == q.shape
