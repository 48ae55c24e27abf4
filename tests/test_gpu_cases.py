"""The GPU check's verdicts, on the CPU with stand-in runners: the exact reference passes, and
runners with the faults the check exists to catch (wrong values, loads past a sequence's last
key, writes past its last row) fail. Also: every case of the suite maps to a kernel
configuration the library builds."""

import collections

import pytest
import torch

import gpu_cases as gpu_check
from fmha.reference import attention_reference, cast_output

CASE = gpu_check.Case("bfloat16", 64, "none", varlen_q=(100, 0, 200, 0), varlen_k=(150, 20, 130, 7),
                      heads_q=2, heads_k=1)


def exact(problem, q, k, v, out, lse, cu_q, cu_k, sinks=None):
    o, l = attention_reference(q, k, v, cu_q, cu_k, mask=problem.mask, compute_dtype=torch.float64)
    out.copy_(cast_output(o, out.dtype))
    if lse is not None:
        lse.copy_(l)


def reads_past_the_last_key(problem, q, k, v, out, lse, cu_q, cu_k, tile=128):
    """Like a kernel whose K/V tile loads run into the next sequence: masked keys get P = 0, but
    their V rows still enter the product."""
    exact(problem, q, k, v, out, lse, cu_q, cu_k)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        if q1 == q0 or k1 == k0:
            continue
        end = min(k0 + -(-(k1 - k0) // tile) * tile, k.shape[0])
        g = q.shape[1] // k.shape[1]
        kk = k[k0:end].double().repeat_interleave(g, dim=1)
        vv = v[k0:end].double().repeat_interleave(g, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * problem.score_scale
        s[:, :, k1 - k0:] = -torch.inf
        p = torch.softmax(s, dim=-1)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vv).to(out.dtype)


def writes_past_the_last_row(problem, q, k, v, out, lse, cu_q, cu_k, sinks=None):
    exact(problem, q, k, v, out, lse, cu_q, cu_k)
    out.as_strided((1,) + out.shape[1:], out.stride(), out.storage_offset() + out.shape[0] * out.stride(0)).zero_()


def test_the_exact_reference_passes():
    assert gpu_check.run_case(exact, CASE, torch, "cpu")["ok"]


def test_loads_past_a_sequence_end_are_caught():
    res = gpu_check.run_case(reads_past_the_last_key, CASE, torch, "cpu")
    assert not res["ok"] and res["nan_in_o"] > 0


def test_writes_past_the_last_row_are_caught():
    res = gpu_check.run_case(writes_past_the_last_row, CASE, torch, "cpu")
    assert not res["ok"] and res["guard_written"] > 0


def test_the_suite_poisons_unread_keys_in_every_varlen_set_that_has_them():
    cases = [c for c in gpu_check.build_suite("full") if c.varlen_q]
    assert any(0 in c.varlen_q and c.varlen_k[c.varlen_q.index(0)] > 0 for c in cases)
    k = torch.zeros(CASE.varlen_k and sum(CASE.varlen_k), 1, 4)
    v = torch.zeros_like(k)
    gpu_check.poison_unread_keys(k, v, CASE.varlen_q, CASE.varlen_k)
    assert k[150:170].isnan().all() and k[300:307].isnan().all() and not k[:150].isnan().any()


def test_every_case_has_a_library_configuration_and_claim_cases_claim():
    pytest.importorskip("cutlass")
    cases = gpu_check.build_suite("full")
    configs = collections.Counter(gpu_check.config_of(c, torch) for c in cases)
    assert len(cases) > 800 and len(configs) > 200
    assert all(gpu_check.config_of(c, torch).claims_tiles for c in cases if c.claim)
    names = [c.name() for c in cases]
    assert len(set(names)) == len(names)


def test_the_backward_cases_pass_with_the_reference_backend():
    """The backward check's plumbing (varlen included: cu_seqlens reach the reference forward,
    the backward under test and the reference backward) on the CPU; a wrong gradient fails."""
    varlen = [c for c in gpu_check.build_backward_suite() if c.varlen_q is not None]
    assert varlen and any(0 in c.varlen_q for c in varlen) and any(1 in c.varlen_q for c in varlen)
    for case in varlen[:3]:
        assert gpu_check.run_backward_case(case, torch, "cpu", backend="reference")["ok"], case.name()
    deterministic = next(c for c in gpu_check.build_backward_suite() if c.deterministic)
    res = gpu_check.run_backward_case(deterministic, torch, "cpu", backend="reference")
    assert res["ok"] and res["repeatable"]


def test_the_backward_check_fails_a_wrong_gradient(monkeypatch):
    import fmha

    real = fmha.attention_backward

    def off_by_a_little(*args, dq=None, **kwargs):
        real(*args, dq=dq, **kwargs)
        dq.mul_(1.05)

    monkeypatch.setattr(fmha, "attention_backward", off_by_a_little)
    case = next(c for c in gpu_check.build_backward_suite() if c.varlen_q is not None)
    assert not gpu_check.run_backward_case(case, torch, "cpu", backend="reference")["ok"]
