"""A gpt-oss-like model (sinks, sliding windows, GQA) and a Gemma-2-like one (softcap, sliding
windows, GQA) train a few steps with fmha and give the losses, and the sinks' gradients, of the
same models with attention written out in eager PyTorch (``variant_models.py``). On the CPU
fmha runs its reference; ``test_gpu_variant_models.py`` runs the Hopper kernels."""

import pytest
from variant_models import STYLES, assert_matches_eager, train_losses


@pytest.mark.parametrize("style", sorted(STYLES))
def test_training_matches_eager(style):
    assert_matches_eager(style, train_losses(style, use_fmha=True, steps=3, shape=(2, 150)),
                         train_losses(style, use_fmha=False, steps=3, shape=(2, 150)), 2e-3, 3e-2)
