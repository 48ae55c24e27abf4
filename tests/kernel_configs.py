"""The Hopper kernel configuration the library builds for a choice of inputs, made on the CPU
through the library's own rules (``HopperForwardConfig.from_problem`` on a validated problem),
so that the tests that compile kernels or check the host's choices build exactly the kernels
the library builds."""

import dataclasses

import torch

from fmha.kernels.hopper.config import HopperForwardConfig
from fmha.problem import KernelOptions
from fmha.validation import validate

MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "causal_bottom_right": dict(causal=True, mask_align="bottom_right"),
    "window": dict(window_size=(100, 30)),
    "left_window": dict(window_size=(64, None)),
    "compressed_causal": dict(compressed_causal=True),
}


def problem_for(dtype=torch.bfloat16, head_dim=128, mask="none", varlen=False, lse=True, out_dtype=None,
                seqlen_k=1024, batch=1, heads_q=4, heads_k=4, head_dim_v=None):
    """A validated problem of these choices; sizes are set afterwards (no large tensors)."""
    rows = 8
    dv = head_dim if head_dim_v is None else head_dim_v
    if varlen:
        q = torch.zeros(rows, heads_q, head_dim).to(dtype)
        k = torch.zeros(rows, heads_k, head_dim).to(dtype)
        v = torch.zeros(rows, heads_k, dv).to(dtype)
        cu = torch.tensor([0, rows], dtype=torch.int32)
        problem = validate(q, k, v, varlen=True, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=lse,
                           out_dtype=out_dtype, **MASKS[mask])
        return dataclasses.replace(problem, seqlen_q=seqlen_k, seqlen_k=seqlen_k)
    q = torch.zeros(1, rows, heads_q, head_dim).to(dtype)
    k = torch.zeros(1, rows, heads_k, head_dim).to(dtype)
    v = torch.zeros(1, rows, heads_k, dv).to(dtype)
    problem = validate(q, k, v, return_lse=lse, out_dtype=out_dtype, **MASKS[mask])
    return dataclasses.replace(problem, batch=batch, seqlen_q=seqlen_k, seqlen_k=seqlen_k,
                               total_q=batch * seqlen_k, total_k=batch * seqlen_k)


def library_config(dtype=torch.bfloat16, head_dim=128, mask="none", persistent=None, varlen=False, lse=True,
                   out_dtype=None, tile=None, seqlen_k=1024, claim_tiles=None,
                   head_dim_v=None) -> HopperForwardConfig:
    """The configuration ``fmha`` builds for these choices at ``seqlen_k`` keys (one batch entry
    of four heads: causal problems of that size keep the static persistent walk)."""
    options = KernelOptions(persistent=persistent, tile_m=tile[0] if tile else None,
                            tile_n=tile[1] if tile else None, claim_tiles=claim_tiles)
    return HopperForwardConfig.from_problem(
        problem_for(dtype, head_dim, mask, varlen, lse, out_dtype, seqlen_k, head_dim_v=head_dim_v), options)
