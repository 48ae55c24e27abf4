"""The arithmetic of ``softmax.exp2_on_fma`` (its PTX, step for step in fp32 numpy): the cubic's
constants, the rounding trick and the exponent add give 2^x within 1.1e-4 relative, and exactly 0
for masked scores (-inf) and anything at or below -127."""

import struct

import numpy as np
import pytest

from fmha.kernels.common import softmax


def _f32(hex_text: str) -> np.float32:
    return np.float32(struct.unpack("<f", struct.pack("<I", int(hex_text[2:], 16)))[0])


def exp2_model(x: np.ndarray) -> np.ndarray:
    c1, c2, c3 = (_f32(h) for h in softmax._EXP2_POLY)
    magic = _f32("0f4B400000")
    x = np.maximum(x.astype(np.float32), _f32("0fC2FE0000"))
    n = (x + magic).astype(np.float32)
    f = (x - (n - magic).astype(np.float32)).astype(np.float32)
    p = (f * c3 + c2).astype(np.float32)
    p = (p * f + c1).astype(np.float32)
    p = (p * f + np.float32(1.0)).astype(np.float32)
    e = (n.view(np.uint32) << np.uint32(23)).astype(np.uint32)
    return (p.view(np.uint32) + e).astype(np.uint32).view(np.float32)


def test_constants_are_the_ptx_ones():
    assert _f32("0f4B400000") == 1.5 * 2 ** 23 and _f32("0fC2FE0000") == -127.0


@pytest.mark.parametrize("lo,hi", [(-126.0, 8.0), (-1.0, 1.0), (-30.0, 0.0)])
def test_relative_error_below_bf16_and_fp16_rounding(lo, hi):
    x = np.linspace(lo, hi, 200_001, dtype=np.float32)
    with np.errstate(over="ignore"):
        got = exp2_model(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 1.1e-4


def test_masked_and_underflowing_scores_give_exactly_zero():
    x = np.array([-np.inf, -1e30, -200.0, -127.0], dtype=np.float32)
    assert np.all(exp2_model(x) == 0.0) and not np.signbit(exp2_model(x)).any()
    near = exp2_model(np.array([-126.9, -126.6], dtype=np.float32))
    assert np.all((near >= 0) & (near < 2.0 ** -126))  # subnormal at most, never a wrapped exponent
