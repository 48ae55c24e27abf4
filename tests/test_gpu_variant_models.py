"""``test_variant_models.py`` on the Hopper kernels (``backend="kernel"``, forward and backward,
no fallback): a gpt-oss-like model with sinks and a Gemma-2-like one with softcap train a few
steps with the losses and sinks' gradients of the eager PyTorch models. Marked ``gpu``."""

import pytest
import torch

from variant_models import STYLES, assert_matches_eager, train_losses

pytestmark = pytest.mark.gpu
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _HOPPER, reason="needs a Hopper (SM90) GPU")
@pytest.mark.parametrize("style", sorted(STYLES))
def test_training_with_the_kernels_matches_eager(style):
    kw = dict(steps=5, shape=(4, 385), device="cuda")
    assert_matches_eager(style, train_losses(style, use_fmha=True, backend="kernel", **kw),
                         train_losses(style, use_fmha=False, **kw), 5e-3, 5e-2)
