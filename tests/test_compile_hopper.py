"""Compile the Hopper kernel for sm_90a without a GPU (fake tensors, TVM FFI environment stream)
for every supported dtype x head dim x mask kind x scheduling mode, and check that the machine
code has warpgroup MMAs and TMA loads: a change that breaks compilation fails here, in CI."""

import itertools

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.hopper.backend import (  # noqa: E402
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    HopperConfig,
    compile_kernel,
    default_tile_m,
)
from fmha.masking import MaskKind  # noqa: E402

# mask kind, window left bounded, window right bounded, bottom-right alignment
MASKS = {
    "none": (MaskKind.NONE, False, False, False),
    "causal": (MaskKind.WINDOW, False, True, False),
    "causal_bottom_right": (MaskKind.WINDOW, False, True, True),
    "window": (MaskKind.WINDOW, True, True, False),
    "compressed_causal": (MaskKind.COMPRESSED_CAUSAL, False, False, False),
}


def _config(dtype, head_dim, mask, persistent, varlen=False, lse=True, out_dtype=None):
    kind, wl, wr, br = MASKS[mask]
    return HopperConfig(dtype, out_dtype or dtype, head_dim, kind, wl, wr, br, varlen, lse,
                        persistent, tile_m=default_tile_m(head_dim))


@pytest.mark.parametrize(
    "dtype,head_dim,mask,persistent",
    list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, ["none", "causal", "window", "compressed_causal"], [True, False])),
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_compiles(dtype, head_dim, mask, persistent):
    assert compile_kernel(_config(dtype, head_dim, mask, persistent)) is not None


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_compiles_varlen_bottom_right_no_lse_other_out_dtype(head_dim):
    cfg = _config(torch.float16, head_dim, "causal_bottom_right", False, varlen=True, lse=False,
                  out_dtype=torch.bfloat16)
    assert compile_kernel(cfg) is not None


def test_machine_code_has_wgmma_and_tma(tmp_path):
    compile_kernel(_config(torch.bfloat16, 128, "causal", True),
                   extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx
