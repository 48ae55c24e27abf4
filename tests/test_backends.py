"""Dispatch and the compile cache, with a fake kernel backend standing in for the GPU one."""

import dataclasses
import logging

import pytest
import torch

import fmha
from fmha import backends
from fmha.masking import MaskSpec
from fmha.problem import KernelOptions
from fmha.validation import validate
from fmha.reference import attention_reference


class FakeKernel:
    """Follows the kernel backend interface; computes with the reference so results can be
    checked, counts compilations, and refuses head dim 128."""

    name = "fake"

    def __init__(self):
        self.prepared = []
        self.calls = 0

    def why_unsupported(self, problem, options):
        return ["head dim 128 is not built"] if problem.head_dim == 128 else []

    def cache_key(self, problem, options):
        return (problem.dtype, problem.head_dim, problem.mask.kind)

    def prepare(self, problem, options):
        self.prepared.append(problem)

        def run(problem, q, k, v, out, lse, cu_q, cu_k, sinks=None):
            self.calls += 1
            for lens, cu in ((problem.seqlens_q, cu_q), (problem.seqlens_k, cu_k)):
                if lens is not None:  # a problem whose lengths were read: this call's offsets'
                    assert list(lens) == cu.diff().tolist(), (lens, cu)
            o, l = attention_reference(q, k, v, cu_q, cu_k, mask=problem.mask,
                                       softmax_scale=problem.softmax_scale)
            out.copy_(o)
            if lse is not None:
                lse.copy_(l)

        return run


@pytest.fixture
def fake(monkeypatch):
    """A GPU-less world in which the fake kernel backend is the only one and the platform fits."""
    kernel = FakeKernel()
    monkeypatch.setattr(backends, "kernel_backends", lambda: ((kernel,), ()))
    monkeypatch.setattr(backends, "_platform_reasons", lambda device: [])
    monkeypatch.setattr(backends, "_runners", {})
    monkeypatch.setattr(backends, "_dispatch_memo", {})
    monkeypatch.setattr(backends, "_logged_reasons", set())
    return kernel


def qkv(s=32, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, 2, d, generator=g).half() for _ in range(3)]


def test_auto_uses_supporting_kernel(fake):
    q, k, v = qkv()
    o = fmha.attention(q, k, v, causal=True)
    assert fake.calls == 1
    want = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True))[0].half()
    assert torch.equal(o, want)


def test_second_call_with_other_sizes_does_not_recompile(fake):
    for s in (32, 48, 80):
        fmha.attention(*qkv(s=s), causal=True)
    assert fake.calls == 3 and len(fake.prepared) == 1
    # scales reach the runner with each call's problem, not the one it was prepared with
    q, k, v = qkv()
    o = fmha.attention(q, k, v, causal=True, softmax_scale=0.01)
    assert len(fake.prepared) == 1
    want = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True), softmax_scale=0.01)
    assert torch.equal(o, want[0].half())
    fmha.attention(*qkv(), causal=False)  # another mask: another key
    assert len(fake.prepared) == 2


def test_fused_attention_shares_the_cache(fake):
    q, k, v = qkv()
    fmha.attention(q, k, v)
    fa = fmha.FusedAttention(q, k, v, torch.empty_like(q))
    assert fa.check_support() is True
    fa.compile()
    assert fa.backend_name == "fake" and len(fake.prepared) == 1


def test_kernel_backend_reports_backend_reasons(fake):
    with pytest.raises(fmha.UnsupportedError, match="fake: head dim 128 is not built"):
        fmha.attention(*qkv(d=128), backend="kernel")
    assert fake.prepared == []


def test_auto_falls_back_when_backend_refuses(fake, caplog):
    q, k, v = qkv(d=128)
    with caplog.at_level(logging.WARNING, logger="fmha"):
        o1 = fmha.attention(q, k, v)
        fmha.attention(q, k, v)
    assert fake.calls == 0
    assert torch.equal(o1, attention_reference(q, k, v)[0].half())
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["fmha: using the PyTorch reference: fake: head dim 128 is not built"]


def test_reference_backend_is_forced(fake):
    fmha.attention(*qkv(), backend="reference")
    assert fake.calls == 0


def test_import_failure_is_a_reason(monkeypatch):
    monkeypatch.setattr(backends, "_platform_reasons", lambda device: [])
    monkeypatch.setattr(backends, "kernel_backends",
                        lambda: ((), ("the Hopper kernel could not be imported: boom",)))
    with pytest.raises(fmha.UnsupportedError, match="could not be imported: boom"):
        fmha.attention(*qkv(), backend="kernel")


def test_load_kernel_backends_turns_import_errors_into_reasons(monkeypatch):
    import importlib

    real_import = importlib.import_module

    def failing_import(name, *args, **kwargs):
        if name.startswith("fmha.kernels"):
            raise ImportError("no module for you")
        return real_import(name, *args, **kwargs)

    backends._load_kernel_backends.cache_clear()
    monkeypatch.setattr(importlib, "import_module", failing_import)
    try:
        loaded, reasons = backends._load_kernel_backends()
    finally:
        backends._load_kernel_backends.cache_clear()
    assert loaded == ()
    assert reasons == ("the Hopper kernel could not be imported: no module for you",
                       "the Blackwell kernel could not be imported: no module for you")


def test_each_kernel_backend_is_chosen_only_on_its_own_gpus(monkeypatch):
    """The Hopper kernel for SM90, the Blackwell kernel for SM100/SM103 (compiled for the
    matching arch), the reference elsewhere (consumer Blackwell, SM120, has no tcgen05) with a
    reason that names the GPU."""
    pytest.importorskip("cutlass")
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    problem = validate(q, q, q)
    problem = dataclasses.replace(problem, device=torch.device("cuda", 0))
    loaded, _ = backends.kernel_backends()
    assert [b.name for b in loaded] == ["hopper", "blackwell"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(backends, "_platform_reasons", lambda device: [])
    for capability, chosen in (((9, 0), "hopper"), ((10, 0), "blackwell"), ((10, 3), "blackwell"),
                               ((12, 0), None), ((8, 0), None)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        backend, reasons = backends.unsupported_reasons(problem, KernelOptions())
        assert (backend.name if backend else None) == chosen, capability
        if chosen is None:
            assert any(f"SM{capability[0]}{capability[1]}" in r for r in reasons)
    from fmha.kernels.blackwell.config import BlackwellForwardConfig

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    assert BlackwellForwardConfig.from_problem(problem, KernelOptions()).arch == "sm_103a"


def test_platform_reasons_on_cpu():
    reasons = backends._platform_reasons(torch.device("cpu"))
    assert reasons[0].startswith("inputs are on the CPU")
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in reasons[1]


def test_auto_on_cpu_does_not_import_kernels(monkeypatch):
    def no_import():
        raise AssertionError("kernel modules imported for CPU tensors")

    monkeypatch.setattr(backends, "kernel_backends", no_import)
    assert fmha.attention(*qkv()).shape == (1, 32, 2, 64)
    with pytest.raises(AssertionError, match="kernel modules imported"):
        fmha.attention(*qkv(), backend="kernel")  # wants every reason, so it does look


def test_hopper_backend_through_the_dispatcher(monkeypatch):
    """The real kernel backend speaks the interface (without compiling, so no GPU needed)."""
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    loaded, reasons = backends._load_kernel_backends()
    assert [b.name for b in loaded] == ["hopper", "blackwell"], reasons
    monkeypatch.setattr(backends, "_platform_reasons", lambda device: [])
    small = validate(*qkv(s=32), causal=True)
    large = validate(*qkv(s=80), causal=True, softmax_scale=0.5)
    chosen, why = backends.unsupported_reasons(small, KernelOptions())
    assert chosen is loaded[0] and why == []
    # sizes and scales are per call: the same compiled kernel serves both
    assert chosen.cache_key(small, KernelOptions()) == chosen.cache_key(large, KernelOptions())
    chosen, why = backends.unsupported_reasons(small, KernelOptions(tile_m=3, tile_n=5))
    assert chosen is None and why and all(r.startswith(("hopper: ", "blackwell: ")) for r in why)
    assert any(r.startswith("hopper: ") for r in why)


def test_every_reason_includes_the_backends_on_a_wrong_platform(monkeypatch):
    kernel = FakeKernel()
    monkeypatch.setattr(backends, "kernel_backends", lambda: ((kernel,), ()))
    fa = fmha.FusedAttention(*qkv(d=128), torch.empty(1, 32, 2, 128, dtype=torch.float16))
    with pytest.raises(fmha.UnsupportedError) as info:
        fa.check_support()
    assert info.value.reasons[0].startswith("inputs are on the CPU")
    assert "fake: head dim 128 is not built" in info.value.reasons
    # a supported configuration on the CPU is still not run by the kernel
    fa = fmha.FusedAttention(*qkv(), torch.empty(1, 32, 2, 64, dtype=torch.float16))
    with pytest.raises(fmha.UnsupportedError, match="inputs are on the CPU"):
        fa.check_support()


def _counting_validate(monkeypatch, unread=False):
    """Count fmha.api's validations; ``unread``: describe each call as one whose offsets stayed
    on the GPU (what ``max_seqlen_*`` given on a CUDA device does), here on the CPU."""
    from fmha import dispatch

    counts = {"forward": 0, "backward": 0}
    real, real_backward = dispatch.validate, dispatch.validate_backward

    def validate(*args, **kwargs):
        counts["forward"] += 1
        problem = real(*args, **kwargs)
        return dataclasses.replace(problem, seqlens_q=None, seqlens_k=None) if unread else problem

    def validate_backward(*args, **kwargs):
        counts["backward"] += 1
        return real_backward(*args, **kwargs)

    monkeypatch.setattr(dispatch, "validate", validate)
    monkeypatch.setattr(dispatch, "validate_backward", validate_backward)
    return counts


def _packed(total=32, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, 2, d, generator=g).half() for _ in range(3)]


def test_repeated_varlen_calls_reuse_their_validation_while_the_offsets_are_unchanged(fake, monkeypatch):
    """The offsets were read on the host: a call with the same cu_seqlens tensor, unchanged, skips
    validation; changed in place or replaced, it is read and checked again (bad offsets still fail)."""
    counts = _counting_validate(monkeypatch)
    q, k, v = _packed()
    cu = torch.tensor([0, 5, 5, 32], dtype=torch.int32)

    def check(cu):
        o = fmha.attention_varlen(q, k, v, cu, cu, causal=True)
        want = attention_reference(q, k, v, cu, cu, mask=MaskSpec.from_args(causal=True))[0].half()
        assert torch.equal(o, want)

    for _ in range(3):
        check(cu)
    assert counts["forward"] == 1 and fake.calls == 3
    cu[1] = 3  # in place: torch counts the write
    check(cu)
    assert counts["forward"] == 2
    check(cu.clone())  # a new tensor with the same offsets
    assert counts["forward"] == 3
    cu[2] = 40  # decreasing after it: rejected, however often the tensor passed before
    with pytest.raises(ValueError, match="nondecreasing"):
        fmha.attention_varlen(q, k, v, cu, cu, causal=True)
    assert fake.calls == 5


def test_varlen_calls_whose_offsets_stay_on_the_gpu_share_one_validation(fake, monkeypatch):
    """With max_seqlen_q/k given the problem does not depend on the offsets' values: a training
    loop's new cu_seqlens tensor each step validates once; another max length validates again."""
    counts = _counting_validate(monkeypatch, unread=True)
    q, k, v = _packed()
    for offsets in ([0, 5, 5, 32], [0, 1, 31, 32], [0, 32, 32, 32]):
        cu = torch.tensor(offsets, dtype=torch.int32)
        o = fmha.attention_varlen(q, k, v, cu, cu.clone(), 32, 32)
        assert torch.equal(o, attention_reference(q, k, v, cu, cu)[0].half())
    assert counts["forward"] == 1 and fake.calls == 3
    fmha.attention_varlen(q, k, v, cu, cu, 32, 40)
    assert counts["forward"] == 2


def test_repeated_varlen_backward_calls_reuse_their_validation(fake, monkeypatch):
    counts = _counting_validate(monkeypatch)
    q, k, v = _packed()
    cu = torch.tensor([0, 5, 5, 32], dtype=torch.int32)
    o, lse = fmha.attention_varlen(q, k, v, cu, cu, return_lse=True, backend="reference")
    grads = [fmha.attention_backward(torch.ones_like(o), q, k, v, o, lse, cu, cu) for _ in range(3)]
    assert counts["backward"] == 1 and all(torch.equal(a, b) for g in grads[1:] for a, b in zip(g, grads[0]))
    fmha.attention_backward(torch.ones_like(o), q, k, v, o, lse, cu.clone(), cu)
    assert counts["backward"] == 2


def test_a_remembered_varlen_call_never_outlives_the_offsets_it_read(fake, monkeypatch):
    """Two calls (another ``return_lse``) share one cu_seqlens tensor. A change to it read by one
    of them must not let the other's remembered validation stand: bad offsets still fail, good
    ones reach the kernel with their own lengths (the fake checks them against the offsets)."""
    counts = _counting_validate(monkeypatch)
    q, k, v = _packed()
    cu = torch.tensor([0, 5, 5, 32], dtype=torch.int32)
    fmha.attention_varlen(q, k, v, cu, cu)
    fmha.attention_varlen(q, k, v, cu, cu, return_lse=True)
    cu[1] = 3  # good offsets, read by the second call first
    fmha.attention_varlen(q, k, v, cu, cu, return_lse=True)
    fmha.attention_varlen(q, k, v, cu, cu)
    assert counts["forward"] == 4 and fake.calls == 4
    cu[2] = 40  # bad offsets, rejected by the second call first...
    with pytest.raises(ValueError, match="nondecreasing"):
        fmha.attention_varlen(q, k, v, cu, cu, return_lse=True)
    with pytest.raises(ValueError, match="nondecreasing"):  # ...and by the first
        fmha.attention_varlen(q, k, v, cu, cu)
    assert fake.calls == 4


def test_new_offsets_every_step_reach_the_kernel_with_their_own_lengths(fake, monkeypatch):
    """A loop that builds a new cu_seqlens tensor each step (and drops the last, so its address
    and id may come back) validates each new tensor and never reuses another's lengths."""
    counts = _counting_validate(monkeypatch)
    q, k, v = _packed()
    for step in range(12):
        cut = 1 + (7 * step) % 30
        cu = torch.tensor([0, cut, 32], dtype=torch.int32)
        o = fmha.attention_varlen(q, k, v, cu, cu, causal=True)
        assert torch.equal(o, attention_reference(q, k, v, cu, cu, mask=MaskSpec.from_args(causal=True))[0].half())
        del cu, o
    assert counts["forward"] == 12 and fake.calls == 12
