"""The ``HopperConfig`` the library builds for a choice of inputs, made without a GPU or tensors:
one helper for the tests that compile kernels or check the host's choices, so that they build the
kernels ``HopperConfig.from_problem`` builds (``shape_choices``) rather than near copies."""

import torch

from fmha.kernels.hopper.backend import HopperConfig, default_tile, shape_choices
from fmha.masking import MaskKind, later_rows_cost_more
from fmha.problem import default_out_dtype

# mask kind, window left bounded, window right bounded, bottom-right alignment
MASKS = {
    "none": (MaskKind.NONE, False, False, False),
    "causal": (MaskKind.WINDOW, False, True, False),
    "causal_bottom_right": (MaskKind.WINDOW, False, True, True),
    "window": (MaskKind.WINDOW, True, True, False),
    "left_window": (MaskKind.WINDOW, True, False, False),
    "compressed_causal": (MaskKind.COMPRESSED_CAUSAL, False, False, False),
}


def library_config(dtype=torch.bfloat16, head_dim=128, mask="none", persistent=True, varlen=False, lse=True,
                   out_dtype=None, tile=None, seqlen_k=1024, l2_sections=False) -> HopperConfig:
    """The configuration for these choices at ``seqlen_k`` keys. ``l2_sections`` (the static
    persistent walk in sections of heads, a benchmark variant) is walked only under causal-like
    masks on a persistent grid."""
    kind, left, right, bottom_right = MASKS[mask]
    tile_m, tile_n = tile or default_tile(dtype, head_dim)
    return HopperConfig(dtype, out_dtype or default_out_dtype(dtype), head_dim, kind, left, right, bottom_right,
                        varlen, lse, persistent, tile_m=tile_m, tile_n=tile_n, l2_sections=l2_sections,
                        **shape_choices(dtype, persistent, head_dim, seqlen_k, later_rows_cost_more(kind, left)))
