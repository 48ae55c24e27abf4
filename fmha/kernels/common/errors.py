"""Input errors a kernel finds: bits ORed into the device's error flag (``fmha.device_errors``)."""

import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def flag_error(errors: cute.Tensor, bit: int):
    """OR ``bit`` into ``errors[0]``: several errors of one call all reach the host."""
    cute.arch.atomic_or(errors.iterator, Int32(bit))
