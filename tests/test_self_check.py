"""The first-use self-check (``fmha.self_check``) on the CPU, with stand-in kernels: a correct one
passes and is remembered; a wrong one (forward or backward) is caught, warns once, falls back to
the reference for that call and later ones, and is remembered as unusable across processes
(the disk-cache mark). The small problem keeps the configuration of the call it stands for."""

import dataclasses
import logging

import pytest
import torch

from fmha import backends, self_check
from fmha.problem import KernelOptions
from fmha.validation import validate


@pytest.fixture
def forced(monkeypatch, tmp_path):
    monkeypatch.setenv("FMHA_SELF_CHECK", "1")
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    return tmp_path


def _problem(dtype=torch.bfloat16, varlen=False, **mask):
    if varlen:
        cu = torch.tensor([0, 5, 12], dtype=torch.int32)
        q, k = torch.randn(12, 4, 64).to(dtype), torch.randn(12, 2, 64).to(dtype)
        return validate(q, k, k, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, **mask)
    q, k = torch.randn(1, 9, 4, 64).to(dtype), torch.randn(1, 9, 2, 64).to(dtype)
    return validate(q, k, k, return_lse=True, **mask)


class Counting:
    def __init__(self, fn, wrong=False):
        self.fn, self.wrong, self.calls = fn, wrong, 0

    def __call__(self, problem, *args):
        self.calls += 1
        self.fn(problem, *args)
        if self.wrong:  # the forward's out, or the backward's dq
            args[3 if len(args) <= 8 else 7].mul_(1.1)


def _call_forward(runner, problem):
    small, q, k, v, cu_q, cu_k, _ = self_check.small_inputs(problem)
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=small.out_dtype)
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1]) if not small.varlen else torch.empty(q.shape[1], q.shape[0])
    runner(small, q, k, v, out, lse, cu_q, cu_k)
    return out


def test_a_correct_kernel_passes_once_and_is_remembered(forced):
    problem = _problem()
    kernel = Counting(backends.REFERENCE.run)
    runner = self_check.SelfCheckedRunner(kernel, "forward", "stand-in", "cfg-ok", backends.REFERENCE.run)
    _call_forward(runner, problem)
    _call_forward(runner, problem)
    assert runner.usable and kernel.calls == 3  # the check's small problem, then two calls
    assert [p.read_text() for p in forced.glob("*.selfcheck")] == ["ok"]
    again = Counting(backends.REFERENCE.run)
    _call_forward(self_check.SelfCheckedRunner(again, "forward", "stand-in", "cfg-ok", backends.REFERENCE.run), problem)
    assert again.calls == 1  # a later process trusts the mark


def test_a_wrong_kernel_falls_back_with_one_warning_and_is_remembered(forced, caplog):
    problem = _problem(varlen=True, causal=True)
    kernel = Counting(backends.REFERENCE.run, wrong=True)
    runner = self_check.SelfCheckedRunner(kernel, "forward", "stand-in", "cfg-bad", backends.REFERENCE.run)
    with caplog.at_level(logging.WARNING, logger="fmha"):
        got = _call_forward(runner, problem)
        _call_forward(runner, problem)
    assert runner.usable is False and kernel.calls == 1  # only the check ran it
    warnings = [r.getMessage() for r in caplog.records if "self-check" in r.getMessage()]
    assert len(warnings) == 1 and "O relative L2 error" in warnings[0] and "reference" in warnings[0]
    want = _call_forward(backends.REFERENCE.run, problem)
    assert torch.equal(got, want)
    marks = list(forced.glob("*.selfcheck"))
    assert len(marks) == 1 and marks[0].read_text().startswith("mismatch")
    later = Counting(backends.REFERENCE.run, wrong=True)
    _call_forward(self_check.SelfCheckedRunner(later, "forward", "stand-in", "cfg-bad", backends.REFERENCE.run),
                  problem)
    assert later.calls == 0


def test_a_wrong_backward_is_caught(forced):
    problem = _problem(window_size=(3, 0))
    good = self_check.SelfCheckedRunner(Counting(backends.REFERENCE.run_backward), "backward", "stand-in", "b-ok",
                                        backends.REFERENCE.run_backward)
    bad = self_check.SelfCheckedRunner(Counting(backends.REFERENCE.run_backward, wrong=True), "backward",
                                       "stand-in", "b-bad", backends.REFERENCE.run_backward)
    assert good._check(problem) and not bad._check(problem)


def test_a_kernel_that_raises_fails_its_check(forced):
    def broken(*args):
        raise RuntimeError("launch failed")

    runner = self_check.SelfCheckedRunner(broken, "forward", "stand-in", "cfg-raises", backends.REFERENCE.run)
    _call_forward(runner, _problem())
    assert runner.usable is False


@pytest.mark.parametrize("mask", [{}, {"causal": True}, {"window_size": (7, 2), "mask_align": "bottom_right"},
                                  {"compressed_causal": True}])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_small_problem_keeps_the_configuration(mask, varlen, dtype):
    pytest.importorskip("cutlass")
    from fmha.kernels.hopper.config import HopperForwardConfig

    problem = dataclasses.replace(_problem(dtype, varlen, **mask), scale_q=0.5, softmax_scale=0.3)
    small = self_check.small_inputs(problem)[0]
    same = ("dtype", "out_dtype", "head_dim", "head_dim_v", "mask", "varlen", "return_lse", "softmax_scale",
            "scale_q", "scale_k", "scale_v", "inv_scale_o")
    assert all(getattr(small, f) == getattr(problem, f) for f in same)
    assert small.num_heads_q // small.num_heads_k == problem.num_heads_q // problem.num_heads_k
    fixed = ("dtype", "out_dtype", "head_dim", "mask_kind", "window_left_bounded", "window_right_bounded",
             "bottom_right", "varlen", "has_lse")
    a, b = (HopperForwardConfig.from_problem(p, KernelOptions()) for p in (problem, small))
    assert all(getattr(a, f) == getattr(b, f) for f in fixed)


def test_who_is_checked(monkeypatch):
    monkeypatch.delenv("FMHA_SELF_CHECK", raising=False)
    assert not self_check.wanted(torch.device("cpu"))
    monkeypatch.setenv("FMHA_SELF_CHECK", "1")
    assert self_check.wanted(torch.device("cpu"))
    monkeypatch.setenv("FMHA_SELF_CHECK", "0")
    assert not self_check.wanted(torch.device("cuda", 0))
    assert (9, 0) in self_check.VERIFIED_CAPABILITIES
