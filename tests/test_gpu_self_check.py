"""The first-use self-check on the H200, forced with ``FMHA_SELF_CHECK=1`` (Hopper is a verified
architecture, so it is off there by default): the Hopper kernels pass it (forward, varlen with
the GPU-built tile list, fp8, backward); a deliberately broken configuration fails it, warns,
and its calls get the reference's results. Marked ``gpu``; skipped without Hopper."""

import logging

import pytest
import torch

import fmha
from fmha import backends, self_check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)), reason="needs a Hopper GPU")]


@pytest.fixture
def forced(monkeypatch, tmp_path):
    """Self-checks on, a fresh kernel cache (compiles again), no prepared runners."""
    monkeypatch.setenv("FMHA_SELF_CHECK", "1")
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    backends.clear_cache()
    yield tmp_path
    backends.clear_cache()


def _inputs(dtype=torch.bfloat16, shape=(2, 333, 8, 128), heads_k=2, grad=False):
    gen = torch.Generator(device="cuda").manual_seed(7)
    b, s, h, d = shape
    q = torch.randn(b, s, h, d, generator=gen, device="cuda").to(dtype)
    k, v = (torch.randn(b, s, heads_k, d, generator=gen, device="cuda").to(dtype) for _ in range(2))
    return [t.requires_grad_(grad) for t in (q, k, v)]


def test_the_hopper_kernels_pass_their_self_check(forced, caplog):
    with caplog.at_level(logging.WARNING, logger="fmha"):
        q, k, v = _inputs()
        fmha.attention(q, k, v, causal=True, backend="kernel")
        lens = [100, 0, 233, 1]
        cu = torch.tensor([0, 100, 100, 333, 334], dtype=torch.int32, device="cuda")
        packed = [t.reshape(-1, *t.shape[2:])[:334] for t in (q, k, v)]
        fmha.attention_varlen(*packed, cu, cu, max(lens), max(lens), window_size=(64, 0), backend="kernel")
        q8, k8, v8 = _inputs(torch.float8_e4m3fn)
        fmha.attention(q8, k8, v8, backend="kernel")
        qg, kg, vg = _inputs(grad=True)
        fmha.attention(qg, kg, vg, causal=True, backend="kernel").sum().backward()
    checked = [r for r in backends._runners.values() if isinstance(r, self_check.SelfCheckedRunner)]
    # four forwards (the autograd call's writes the LSE: another configuration), one backward
    assert len(checked) == 5 and all(r.usable for r in checked)
    assert {r.kind for r in checked} == {"forward", "backward"}
    assert not [r for r in caplog.records if "self-check" in r.getMessage()]
    marks = sorted(p.read_text() for p in forced.glob("*.selfcheck"))
    assert marks == ["ok"] * 5


def test_a_broken_configuration_falls_back_with_a_warning(forced, caplog, monkeypatch):
    from fmha.kernels.hopper.backend import HopperBackend

    real_prepare = HopperBackend.prepare

    def broken_prepare(self, problem, options):
        runner = real_prepare(self, problem, options)

        def off(problem, q, k, v, out, lse, cu_q, cu_k, sinks=None):
            runner(problem, q, k, v, out, lse, cu_q, cu_k)
            out.mul_(1.1)  # wrong by 10%

        return off

    monkeypatch.setattr(HopperBackend, "prepare", broken_prepare)
    q, k, v = _inputs()
    with caplog.at_level(logging.WARNING, logger="fmha"):
        got = fmha.attention(q, k, v, causal=True)
        again = fmha.attention(q, k, v, causal=True)
    warnings = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert len(warnings) == 1 and "runs the PyTorch reference" in warnings[0]
    want = fmha.attention(q, k, v, causal=True, backend="reference")
    assert torch.equal(got, want) and torch.equal(again, want)
    marks = [p.read_text() for p in forced.glob("*.selfcheck")]
    assert len(marks) == 1 and marks[0].startswith("mismatch: O relative L2 error")
