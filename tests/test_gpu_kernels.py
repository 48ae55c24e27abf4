"""The GPU check: every case of ``gpu_cases.build_suite`` through the kernel the library builds
for it, against the fp32 reference, and the fp8 V staging kernel byte for byte. Marked ``gpu``;
skipped without a Hopper GPU.

    python -m pytest -m gpu                                   # the full matrix (about 850 cases)
    python -m pytest -m gpu --gpu-suite quick                 # a few cases
    python -m pytest -m gpu --gpu-report results/gpu_check    # also results.json / results.md

The kernels are compiled first, all at once, in parallel worker processes that write the
on-disk kernel cache of a temporary directory; each test then loads its kernel from there.
"""

import contextlib
import os
import time
from dataclasses import asdict

import pytest
import torch

import gpu_cases

pytestmark = pytest.mark.gpu

_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
_needs_hopper = pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (SM90) GPU")
# The report's rows, in the order the tests ran (``conftest.pytest_sessionfinish`` writes them).
RESULTS: list = []
META: dict = {}


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = gpu_cases.build_suite(metafunc.config.getoption("--gpu-suite"))
        metafunc.parametrize("case", cases, ids=[f"{i}:{c.name()}" for i, c in enumerate(cases)])


@pytest.fixture(scope="session")
def runners(request, tmp_path_factory):
    """config -> HopperRunner for every case of the suite, compiled in parallel first."""
    from fmha.jit import disk_cache
    from fmha.kernels.hopper.forward_runner import HopperRunner, compile_forward

    cases = gpu_cases.build_suite(request.config.getoption("--gpu-suite"))
    configs = sorted({gpu_cases.config_of(c, torch) for c in cases}, key=repr)
    cache_dir = str(tmp_path_factory.mktemp("kernels"))
    start = time.time()
    gpu_cases.compile_all(configs, cache_dir, _workers(request))
    os.environ["FMHA_CACHE_DIR"] = cache_dir
    built = {cfg: HopperRunner(cfg, disk_cache.load_or_compile(cfg, compile_forward)) for cfg in configs}
    META.update(device=torch.cuda.get_device_name(), configs=len(configs), compile_s=round(time.time() - start, 1))
    return built


def _workers(request) -> int:
    return request.config.getoption("--gpu-workers") or max(1, (os.cpu_count() or 2) - 1)


@pytest.fixture(scope="session")
def backward_kernels(request, tmp_path_factory):
    """Every backward kernel of the backward cases, compiled in parallel into the disk cache that
    the library then loads them from."""
    configs = {gpu_cases.backward_config(c, torch) for c in gpu_cases.build_backward_suite()}
    cache_dir = str(tmp_path_factory.mktemp("backward_kernels"))
    start = time.time()
    gpu_cases.compile_all(sorted(configs, key=repr), cache_dir, _workers(request))
    os.environ["FMHA_CACHE_DIR"] = cache_dir
    META.update(backward_configs=len(configs), backward_compile_s=round(time.time() - start, 1))


@_needs_hopper
def test_kernel_matches_the_reference(case, runners):
    from fmha.jit.launch import persistent_grid_of

    runner = runners[gpu_cases.config_of(case, torch)]
    # Claiming cases run on a grid of 8 CTAs, so that each claims several tiles (and cycles
    # through its Q buffers and the hand-off's entries) even in these small problems.
    grid = persistent_grid_of(8, torch.cuda.current_device()) if case.claim else contextlib.nullcontext()
    if case.claim:
        assert runner.cfg.claims_tiles
    with grid:
        res = gpu_cases.run_case(runner, case, torch)
    res.update(case=asdict(case), name=case.name(), config=repr(runner.cfg))
    RESULTS.append(res)
    assert res["ok"], {k: v for k, v in res.items() if k not in ("case", "config")}


@_needs_hopper
@pytest.mark.parametrize("d,kind,spec", gpu_cases.STAGE_V_CASES,
                         ids=[gpu_cases.stage_v_name(*c) for c in gpu_cases.STAGE_V_CASES])
def test_fp8_v_staging_matches_torch(d, kind, spec):
    res = gpu_cases.check_stage_v(d, kind, spec, torch)
    RESULTS.append(res)
    assert res["ok"], res


@_needs_hopper
@pytest.mark.parametrize("bwd_case", gpu_cases.build_backward_suite(), ids=lambda c: "bwd " + c.name())
def test_backward_kernel_matches_the_reference(bwd_case, backward_kernels):
    res = gpu_cases.run_backward_case(bwd_case, torch)
    res.update(case=asdict(bwd_case), name="backward " + bwd_case.name())
    RESULTS.append(res)
    assert res["ok"], res


@_needs_hopper
@pytest.mark.parametrize("dtype,causal", [(torch.float16, False), (torch.float16, True), (torch.bfloat16, False),
                                          (torch.bfloat16, True)],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_backward_of_rows_with_very_negative_scores(dtype, causal):
    """Every score of every row far below 0 (scaled scores about -50, LSE about -45): a key past the sequence in the last
    K/V tile (200 keys: 56 of its 128 rows are past the end) would get P = 2^-lse2, about e^40,
    and dS = -P·delta overflowed to inf, which dQ = dS K turned into NaN through K's zero rows;
    those keys are masked. The gradients hold no NaN and are within twice the error of the same
    attention computed in ``dtype`` with plain torch ops, against fp64 (FlashAttention's criterion:
    dQ here is a near-cancellation of dS against K's large shared direction, so a fixed relative
    tolerance would judge the 16-bit rounding of dS, not the kernel)."""
    import fmha
    from fmha.masking import MaskSpec
    from fmha.reference import attention_reference, cast_output

    g = torch.Generator(device="cuda").manual_seed(7)
    b, s, h, d = 2, 200, 4, 64
    direction = torch.randn(d, generator=g, device="cuda")
    direction /= direction.norm()
    q = (direction * 20 + 0.1 * torch.randn(b, s, h, d, generator=g, device="cuda")).to(dtype)
    k = (-direction * 20 + 0.1 * torch.randn(b, s, h, d, generator=g, device="cuda")).to(dtype)
    v = torch.randn(b, s, h, d, generator=g, device="cuda").to(dtype)
    mask = MaskSpec.from_args(causal=causal)
    out, lse = attention_reference(q, k, v, mask=mask)
    assert lse.max().item() < -30  # the scores are what the test is about
    out = cast_output(out, dtype)
    dout = torch.randn(out.shape, generator=g, device="cuda").to(dtype)

    def plain_torch_grads(compute_dtype):
        leaves = [t.to(compute_dtype).transpose(1, 2).requires_grad_() for t in (q, k, v)]
        scores = leaves[0] @ leaves[1].transpose(-1, -2) * d ** -0.5
        if causal:
            scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
        o = torch.softmax(scores, dim=-1) @ leaves[2]
        o.backward(dout.to(compute_dtype).transpose(1, 2))
        return [t.grad.transpose(1, 2).double() for t in leaves]

    exact, low = plain_torch_grads(torch.float64), plain_torch_grads(dtype)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    fmha.attention_backward(dout, q, k, v, out, lse, causal=causal, dq=grads[0], dk=grads[1], dv=grads[2],
                            backend="kernel")
    for name, got, e, lo in zip("qkv", grads, exact, low):
        assert not torch.isnan(got).any(), f"NaN in d{name}"
        our_err, ref_err = (got.double() - e).norm().item(), (lo - e).norm().item()
        assert our_err <= 2 * ref_err + 1e-3 * e.norm().item(), (name, our_err, ref_err)
