"""The public API on the CPU (reference path) and, where a GPU is present, on CUDA."""

import logging
import subprocess
import sys

import pytest
import torch

import fmha
from fmha import backends, dispatch
from fmha.masking import MaskSpec
from fmha.reference import attention_reference, cast_output


def qkv(b=2, sq=24, sk=40, hq=4, hk=2, d=64, dtype=torch.float16, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).to(device)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hk, d), mk(b, sk, hk, d)


def ref(q, k, v, cu_q=None, cu_k=None, **mask_args):
    return attention_reference(q, k, v, cu_q, cu_k, mask=MaskSpec.from_args(**mask_args))


def test_returns_o_matching_reference():
    q, k, v = qkv()
    o = fmha.attention(q, k, v, causal=True, backend="reference")
    assert o.dtype == torch.float16 and o.shape == q.shape
    assert torch.equal(o, ref(q, k, v, causal=True)[0].to(torch.float16))


def test_return_lse():
    q, k, v = qkv()
    o, lse = fmha.attention(q, k, v, window_size=(4, 2), return_lse=True, backend="reference")
    want_o, want_lse = ref(q, k, v, window_size=(4, 2))
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 24)
    assert torch.equal(lse, want_lse) and torch.equal(o, want_o.half())


def test_preallocated_out_and_lse():
    q, k, v = qkv()
    out = torch.full(q.shape, float("nan"), dtype=torch.float16)
    lse = torch.full((2, 4, 24), float("nan"))
    got = fmha.attention(q, k, v, out=out, lse=lse, backend="reference")
    # written in place, and lse filled although return_lse was not asked for
    assert got is out
    want_o, want_lse = ref(q, k, v)
    assert torch.equal(out, want_o.half()) and torch.equal(lse, want_lse)


def test_preallocated_bhsd_out():
    q, k, v = qkv()
    out = torch.empty(2, 4, 24, 64, dtype=torch.float16).transpose(1, 2)
    fmha.attention(q, k, v, out=out, backend="reference")
    assert torch.equal(out, ref(q, k, v)[0].half())


def test_out_dtype():
    q, k, v = qkv()
    o = fmha.attention(q, k, v, out_dtype=torch.bfloat16, backend="reference")
    assert o.dtype == torch.bfloat16
    f8 = [x.to(torch.float8_e4m3fn) for x in (q, k, v)]
    assert fmha.attention(*f8, backend="reference").dtype == torch.bfloat16
    o8 = fmha.attention(*f8, out_dtype=torch.float8_e4m3fn, inv_scale_o=4.0, backend="reference")
    assert o8.dtype == torch.float8_e4m3fn
    want = ref(*f8)[0] * 4.0  # exact: a power of two
    assert torch.equal(o8, cast_output(want, torch.float8_e4m3fn))


def test_bhsd_view_input():
    q, k, v = qkv()
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v)]
    assert torch.equal(fmha.attention(*views, causal=True, backend="reference"),
                       fmha.attention(q, k, v, causal=True, backend="reference"))


def test_varlen():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(14, 4, 32, generator=g).half()
    k, v = (torch.randn(18, 1, 32, generator=g).half() for _ in range(2))
    cu_q = torch.tensor([0, 5, 5, 14], dtype=torch.int32)  # lengths 5, 0, 9
    cu_k = torch.tensor([0, 7, 9, 18], dtype=torch.int32)  # lengths 7, 2, 9
    o, lse = fmha.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                   mask_align="bottom_right", return_lse=True, backend="reference")
    assert o.shape == (14, 4, 32) and lse.shape == (4, 14)
    want_o, want_lse = ref(q, k, v, cu_q, cu_k, causal=True, mask_align="bottom_right")
    assert torch.equal(o, want_o.half()) and torch.equal(lse, want_lse)


def test_kernel_backend_raises_with_reasons_on_cpu():
    q, k, v = qkv()
    with pytest.raises(fmha.UnsupportedError) as info:
        fmha.attention(q, k, v, backend="kernel")
    assert isinstance(info.value, NotImplementedError)
    assert any("inputs are on the CPU" in r for r in info.value.reasons)
    assert "inputs are on the CPU" in str(info.value)


def test_auto_falls_back_and_logs_each_reason_once(caplog, monkeypatch):
    monkeypatch.setattr(backends, "_logged_reasons", set())
    q, k, v = qkv()
    with caplog.at_level(logging.WARNING, logger="fmha"):
        for _ in range(3):
            o = fmha.attention(q, k, v)
    assert torch.equal(o, ref(q, k, v)[0].half())
    cpu = [r for r in caplog.records if "inputs are on the CPU" in r.getMessage()]
    assert len(cpu) == 1 and cpu[0].name == "fmha"


# --- FusedAttention -----------------------------------------------------------------------

def test_fused_attention_on_reference():
    q, k, v = qkv()
    o, lse = torch.empty_like(q), torch.empty(2, 4, 24)
    fa = fmha.FusedAttention(q, k, v, o, lse, causal=True, softmax_scale=0.2,
                             backend="reference")
    assert fa.check_support() is True
    assert fa.compile() is fa and fa.backend_name == "reference"
    q2, k2, v2 = qkv(seed=1)
    fa.execute(q2, k2, v2, o, lse)
    want_o, want_lse = attention_reference(q2, k2, v2, mask=MaskSpec.from_args(causal=True),
                                           softmax_scale=0.2)
    assert torch.equal(o, want_o.half()) and torch.equal(lse, want_lse)


def test_fused_attention_check_support_lists_every_reason_on_cpu():
    q, k, v = qkv()
    fa = fmha.FusedAttention(q, k, v, torch.empty_like(q))
    with pytest.raises(fmha.UnsupportedError) as info:
        fa.check_support()
    reasons = info.value.reasons
    assert any("inputs are on the CPU" in r for r in reasons)
    assert any("no CUDA device" in r for r in reasons) == (not torch.cuda.is_available())
    # 'auto' still compiles, to the reference
    assert fa.compile().backend_name == "reference"


def test_fused_attention_execute_compiles_on_first_use():
    q, k, v = qkv()
    o = torch.empty_like(q)
    fa = fmha.FusedAttention(q, k, v, o, backend="reference")
    fa.execute(q, k, v, o)
    assert fa.backend_name == "reference" and torch.equal(o, ref(q, k, v)[0].half())


@pytest.mark.parametrize("change,field", [
    (dict(sq=25), "seqlen_q"),
    (dict(hq=8), "num_heads_q"),
    (dict(dtype=torch.bfloat16), "dtype"),
], ids=["seqlen", "heads", "dtype"])
def test_fused_attention_rejects_other_problems(change, field):
    q, k, v = qkv()
    fa = fmha.FusedAttention(q, k, v, torch.empty_like(q), backend="reference")
    q2, k2, v2 = qkv(**change)
    out = torch.empty(q2.shape, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"do not match the samples.*{field}"):
        fa.execute(q2, k2, v2, out)


def test_fused_attention_lse_must_match_samples():
    q, k, v = qkv()
    o = torch.empty_like(q)
    fa = fmha.FusedAttention(q, k, v, o, torch.empty(2, 4, 24), backend="reference")
    with pytest.raises(ValueError, match="return_lse"):
        fa.execute(q, k, v, o)


def test_fused_attention_varlen_new_offsets():
    g = torch.Generator().manual_seed(4)
    q = torch.randn(12, 2, 32, generator=g).half()
    k, v = (torch.randn(12, 2, 32, generator=g).half() for _ in range(2))
    o = torch.empty_like(q)
    cu_a = torch.tensor([0, 6, 12], dtype=torch.int32)
    fa = fmha.FusedAttention(q, k, v, o, cu_seqlens_q=cu_a, cu_seqlens_k=cu_a, max_seqlen_q=8,
                             max_seqlen_k=8, causal=True, backend="reference")
    cu_b = torch.tensor([0, 4, 12], dtype=torch.int32)
    fa.execute(q, k, v, o, cu_seqlens_q=cu_b, cu_seqlens_k=cu_b)
    assert torch.equal(o, ref(q, k, v, cu_b, cu_b, causal=True)[0].half())
    # offsets whose longest sequence exceeds the compiled max_seqlen are refused
    cu_c = torch.tensor([0, 2, 12], dtype=torch.int32)
    with pytest.raises(ValueError, match="smaller than the longest sequence"):
        fa.execute(q, k, v, o, cu_seqlens_q=cu_c, cu_seqlens_k=cu_c)


# --- on a GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_auto_matches_reference(causal, dtype):
    q, k, v = qkv(b=2, sq=300, sk=300, hq=4, hk=2, d=128, dtype=dtype, device="cuda")
    o, lse = fmha.attention(q, k, v, causal=causal, return_lse=True)
    want_o, want_lse = ref(q, k, v, causal=causal)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(o.float(), want_o, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-4)


def test_host_path_does_not_import_cutlass():
    # the CuTe DSL costs about a second to import: only kernel compilation may pull it in
    code = ("import sys, torch, fmha; q = torch.randn(1, 8, 1, 32).half(); "
            "fmha.attention(q, q, q); fmha.FusedAttention(q, q, q, q).compile(); "
            "assert 'cutlass' not in sys.modules, 'cutlass imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fused_attention_unchecked_execute():
    q, k, v = qkv()
    o = torch.empty_like(q)
    fa = fmha.FusedAttention(q, k, v, o, backend="reference")
    fa.execute(q, k, v, o, check=False)
    assert fa.backend_name == "reference" and torch.equal(o, ref(q, k, v)[0].half())


def _counting_validate(monkeypatch):
    calls = []
    real = dispatch.validate

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(dispatch, "validate", counted)
    backends.clear_cache()
    return calls


def test_a_repeated_dense_call_reuses_its_validation(monkeypatch):
    calls = _counting_validate(monkeypatch)
    q, k, v = qkv()
    first = fmha.attention(q, k, v, causal=True, backend="reference")
    q2, k2, v2 = qkv(seed=1)  # same metadata, other data: a hit, and the new data is used
    second = fmha.attention(q2, k2, v2, causal=True, backend="reference")
    assert len(calls) == 1
    assert torch.equal(first, ref(q, k, v, causal=True)[0].half())
    assert torch.equal(second, ref(q2, k2, v2, causal=True)[0].half())
    # any other argument, shape or stride is a new key
    fmha.attention(q, k, v, causal=False, backend="reference")
    fmha.attention(q, k, v, causal=True, softmax_scale=0.5, backend="reference")
    fmha.attention(q[:, :20], k, v, causal=True, backend="reference")
    fmha.attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, causal=True, backend="reference")
    assert len(calls) == 5
    backends.clear_cache()
    fmha.attention(q, k, v, causal=True, backend="reference")
    assert len(calls) == 6


def test_a_repeated_call_still_checks_the_data_pointer_and_reports_bad_arguments(monkeypatch):
    calls = _counting_validate(monkeypatch)
    q, k, v = qkv()
    fmha.attention(q, k, v, backend="reference")
    # same shape, strides and dtype, but 2 bytes past a 16-byte boundary
    shifted = torch.empty(q.numel() + 8, dtype=q.dtype)[1:q.numel() + 1].view(q.shape).copy_(q)
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    with pytest.raises(ValueError, match="16-byte aligned"):
        fmha.attention(shifted, k, v, backend="reference")
    for _ in range(2):  # a tensor scale is refused on every call (by fmha.options), never remembered
        with pytest.raises(TypeError, match="Python float"):
            fmha.attention(q, k, v, scale_q=torch.tensor(1.0), backend="reference")
    with pytest.raises(ValueError, match="backend"):
        fmha.attention(q, k, v, backend="nope")
    assert len(calls) == 2  # the first call and the shifted one: options are checked before validation


def test_meta_fake_tensors_and_flop_counter_without_grad():
    """Shape propagation (meta tensors, FakeTensorMode) and FlopCounterMode need no input that
    requires grad: they go through the custom ops' fake implementations and FLOP formulas
    (PyTorch's SDPA accounting: 2 * H_q * S_q * S_k * (D + D_v), the backward twice that)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    q = torch.empty(1, 8, 2, 16, device="meta")
    o, lse = fmha.attention(q, q, q[..., :8], causal=True, return_lse=True)
    assert o.device.type == "meta" and o.shape == (1, 8, 2, 8) and lse.shape == (1, 2, 8)
    with FakeTensorMode():
        a = torch.empty(1, 8, 2, 16)
        assert fmha.attention(a, a, a).shape == (1, 8, 2, 16)
    q, k, v = torch.randn(2, 8, 4, 16), torch.randn(2, 12, 2, 16), torch.randn(2, 12, 2, 8)
    forward = 2 * 2 * 4 * 8 * 12 * (16 + 8)
    with FlopCounterMode(display=False) as counter:
        fmha.attention(q, k, v)
    assert counter.get_total_flops() == forward
    with FlopCounterMode(display=False) as counter:
        fmha.attention(q.requires_grad_(), k, v).sum().backward()
    assert counter.get_total_flops() == 3 * forward
