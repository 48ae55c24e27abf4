"""A gpt-oss-like model (sinks, sliding windows, GQA) and a Gemma-2-like one (softcap, sliding
windows, GQA) train a few steps with fmha and give the losses, and the sinks' gradients, of the
same models with attention written out in eager PyTorch (``variant_models.py``). On the CPU
fmha runs its reference; ``test_gpu_variant_models.py`` runs the Hopper kernels."""

import pytest
import torch

from variant_models import STYLES, train_losses


@pytest.mark.parametrize("style", sorted(STYLES))
def test_training_matches_eager(style):
    got, got_sinks = train_losses(style, use_fmha=True, steps=3, shape=(2, 150))
    want, want_sinks = train_losses(style, use_fmha=False, steps=3, shape=(2, 150))
    assert want[-1] < want[0]  # it learns, so the comparison is of a moving model
    for g, w in zip(got, want):
        assert abs(g - w) < 2e-3 * abs(w)
    assert len(got_sinks) == len(want_sinks) == (2 if STYLES[style]["sinks"] else 0)
    for g, w in zip(got_sinks, want_sinks):  # each layer's sinks gradient
        assert w.abs().max() > 0
        assert (g - w).norm() < 3e-2 * w.norm()
