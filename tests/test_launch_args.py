"""The host's named argument tuples follow the kernels' ``__call__`` signatures field for field:
a launch passes them positionally, so a parameter added to a kernel without its tuple (or in
another place) would shift every argument after it."""

import inspect

import pytest

pytest.importorskip("cutlass")


def _kernel_parameters(cls):
    names = list(inspect.signature(cls.__call__).parameters)
    assert names[0] == "self" and names[-1] == "stream"
    return tuple(names[1:-1])


def test_hopper_forward_and_backward_arguments():
    from fmha.kernels.hopper.backward_runner import BackwardArgs
    from fmha.kernels.hopper.forward_runner import ForwardArgs
    from fmha.kernels.hopper.bwd import HopperAttentionBackward
    from fmha.kernels.hopper.fwd import HopperAttentionForward

    assert ForwardArgs._fields == _kernel_parameters(HopperAttentionForward)
    assert BackwardArgs._fields == _kernel_parameters(HopperAttentionBackward)


def test_blackwell_forward_arguments():
    from fmha.kernels.blackwell.backend import ForwardArgs
    from fmha.kernels.blackwell.fwd import BlackwellAttentionForward

    assert ForwardArgs._fields == _kernel_parameters(BlackwellAttentionForward)
