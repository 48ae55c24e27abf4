"""The online softmax's stale-max rule (``OnlineSoftmax.max_slack``), modelled tile by tile in
torch on the CPU: the rule gives the exact result, probabilities stay within 2^slack, the
benchmark-like inputs of the GPU check almost never move a row's max after its first tile (what
makes the rule pay), and the check's ``scores="rising"`` cases move it mid-row, so a kernel that
skipped the O rescale when it must not fails them (and passes every ``randn`` case)."""

import math

import pytest
import torch

import gpu_cases as gpu_check  # noqa: E402
from fmha.kernels.common.softmax import MAX_SLACK  # noqa: E402
from fmha.reference import attention_reference, cast_output  # noqa: E402

TILE_N = 128


def tiled_attention(q, k, v, scale, slack, rescale_o=True, stats=None):
    """(B, S, H, D) attention the way the kernel's loop computes it, one key tile at a time, with
    the running max kept in raw score units and moved only by more than ``slack`` (log2 units).
    ``rescale_o=False`` is the fault: O keeps its old scale when the max moves after tile 0."""
    g = q.shape[2] // k.shape[2]
    qq = q.double().transpose(1, 2)
    kk = k.double().repeat_interleave(g, dim=2).transpose(1, 2)
    vv = v.double().repeat_interleave(g, dim=2).transpose(1, 2)
    c = scale * math.log2(math.e)
    b, h, sq, d = qq.shape
    m = torch.full((b, h, sq, 1), -math.inf, dtype=torch.float64)
    l = torch.zeros_like(m)
    o = torch.zeros(b, h, sq, d, dtype=torch.float64)
    for t, j in enumerate(range(0, kk.shape[2], TILE_N)):
        s = qq @ kk[:, :, j:j + TILE_N].transpose(-1, -2)
        cur = torch.maximum(m, s.amax(-1, keepdim=True))
        moved = cur > m + slack / c
        new = torch.where(moved, cur, m)
        p = torch.exp2(s * c - new * c)
        corr = torch.exp2((m - new) * c)
        if stats is not None:
            stats["p_max"] = max(stats.get("p_max", 0.0), p.max().item())
            if t > 0:
                stats["moves"] = stats.get("moves", 0) + int(moved.sum())
                stats["rows"] = stats.get("rows", 0) + moved.numel()
        l = l * corr + p.sum(-1, keepdim=True)
        o = (o * corr if rescale_o or t == 0 else o) + p @ vv[:, :, j:j + TILE_N]
        m = new
    return (o / l).transpose(1, 2)


def _runner(slack, rescale_o=True, stats=None):
    def run(problem, q, k, v, out, lse, cu_q, cu_k, sinks=None):
        out.copy_(cast_output(tiled_attention(q, k, v, problem.score_scale, slack, rescale_o, stats), out.dtype))
        if lse is not None:
            _, ref_lse = attention_reference(q, k, v, mask=problem.mask, compute_dtype=torch.float64)
            lse.copy_(ref_lse)
    return run


def _case(scores):
    return gpu_check.Case("bfloat16", 128, "none", batch=1, seqlen_q=64, seqlen_k=1500, heads_q=2,
                          heads_k=1, scores=scores)


@pytest.mark.parametrize("scores", ["randn", "rising"])
@pytest.mark.parametrize("slack", [0.0, MAX_SLACK])
def test_a_stale_max_gives_the_exact_result(scores, slack):
    stats = {}
    res = gpu_check.run_case(_runner(slack, stats=stats), _case(scores), torch, "cpu")
    assert res["ok"], res
    assert stats["p_max"] <= 2.0 ** slack * (1 + 1e-12)


def test_randn_rows_keep_their_first_max_and_rising_rows_move_it():
    randn, rising = {}, {}
    gpu_check.run_case(_runner(MAX_SLACK, stats=randn), _case("randn"), torch, "cpu")
    gpu_check.run_case(_runner(MAX_SLACK, stats=rising), _case("rising"), torch, "cpu")
    assert randn.get("moves", 0) == 0
    assert rising["moves"] > 0.05 * rising["rows"]


def test_a_kernel_that_skips_the_moved_rescale_fails_only_the_rising_cases():
    assert gpu_check.run_case(_runner(MAX_SLACK, rescale_o=False), _case("randn"), torch, "cpu")["ok"]
    assert not gpu_check.run_case(_runner(MAX_SLACK, rescale_o=False), _case("rising"), torch, "cpu")["ok"]


def test_the_suite_has_rising_cases_for_every_16_bit_mainloop_kind():
    rising = [c for c in gpu_check.build_suite("full") if c.scores == "rising"]
    assert {c.head_dim for c in rising} >= {64, 128, 256}
    assert {c.dtype for c in rising} >= {"bfloat16", "float16"}
    assert {c.mask for c in rising} == {"none", "causal"} and {c.persistent for c in rising} == {True, False}
