"""The comparisons the GPU variant and head-dim tests make against the fp64 reference, and their
varlen offsets."""

import torch


def rel_l2(got, want) -> float:
    """Relative L2 error; a NaN left in ``got`` (an unwritten, poisoned element) counts as huge."""
    got, want = got.double().nan_to_num(nan=1e30), want.double()
    n = want.norm().item()
    return (got - want).norm().item() / (n if n > 0 else 1.0)


def lse_max_err(got, want) -> float:
    """Largest absolute LSE error over the finite rows; the -inf rows (no key kept) must match."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)), "-inf rows differ"
    fin = torch.isfinite(want)
    return (got[fin].double() - want[fin]).abs().max().item() if fin.any() else 0.0


def cu_seqlens(lens):
    """The int32 offsets of sequences of ``lens``, on the GPU."""
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
