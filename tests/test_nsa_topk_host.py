"""The fused top-k kernel's host side (``kernels/hopper/topk_runner.py``), without a GPU: what it
serves and what it refuses with a reason, and the scores it holds per token."""

import pytest
import torch

from fmha.kernels.hopper.topk_runner import SHARED_BYTES, config_of, score_capacity, why_unsupported_topk
from fmha.nsa.topk import TopKProblem


def problem(dtype=torch.bfloat16, d=128, hq=64, hk=4, count=16, max_seqlen=65536, select_block=64):
    return TopKProblem(dtype, d, hq, hk, 32, 16, select_block, count, max_seqlen, torch.device("cuda", 0))


def test_score_capacity_is_a_power_of_two_covering_the_longest_sequence():
    assert score_capacity(1, 64) == 32
    assert score_capacity(64 * 32, 64) == 32 and score_capacity(64 * 32 + 1, 64) == 64
    assert score_capacity(65536, 64) == 1024 and score_capacity(65537, 64) == 2048
    assert score_capacity(1000, 7) == 256  # ceil(1000 / 7) = 143 blocks


def test_the_paper_shapes_are_served():
    assert why_unsupported_topk(problem()) == []
    assert why_unsupported_topk(problem(hq=32, hk=8, max_seqlen=131072)) == []
    assert config_of(problem()).shared_bytes() <= SHARED_BYTES


@pytest.mark.parametrize("kwargs,reason", [
    (dict(dtype=torch.float32), "float16/bfloat16"),
    (dict(d=72), "multiples of 16 up to 256"),
    (dict(d=320), "multiples of 16 up to 256"),
    (dict(hq=24, hk=2), "groups that divide 64"),
    (dict(count=33), "at most 32 blocks"),
    (dict(hq=8, hk=8, max_seqlen=65536), "shared memory"),  # 64 tokens a tile x 1024 scores
])
def test_what_it_refuses_says_why(kwargs, reason):
    reasons = why_unsupported_topk(problem(**kwargs))
    assert reasons and any(reason in r for r in reasons), reasons
