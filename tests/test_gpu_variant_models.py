"""``test_variant_models.py`` on the Hopper kernels (``backend="kernel"``, forward and backward,
no fallback): a gpt-oss-like model with sinks and a Gemma-2-like one with softcap train a few
steps with the losses and sinks' gradients of the eager PyTorch models. Marked ``gpu``."""

import pytest
import torch

from variant_models import STYLES, train_losses

pytestmark = pytest.mark.gpu
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (SM90) GPU")
@pytest.mark.parametrize("style", sorted(STYLES))
def test_training_with_the_kernels_matches_eager(style):
    got, got_sinks = train_losses(style, use_fmha=True, backend="kernel", steps=5, shape=(4, 385), device="cuda")
    want, want_sinks = train_losses(style, use_fmha=False, steps=5, shape=(4, 385), device="cuda")
    assert want[-1] < want[0]
    for g, w in zip(got, want):
        assert abs(g - w) < 5e-3 * abs(w)
    assert len(got_sinks) == len(want_sinks) == (2 if STYLES[style]["sinks"] else 0)
    for g, w in zip(got_sinks, want_sinks):  # each layer's sinks gradient
        assert w.abs().max() > 0
        assert (g - w).norm() < 5e-2 * w.norm()
