"""The device side of ``fmha.mods``' portable functions: what a score or mask mod's ``where``,
``tanh``, ``exp``, ``log`` and ``abs`` become when the DSL traces it in a kernel (fp32 scores,
Int32 indices)."""

import cutlass
import cutlass.cute as cute
from cutlass import Float32


def _numeric(x, like):
    """A Python number as the DSL type of ``like`` (select needs both sides typed alike)."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return type(like)(x) if isinstance(like, cutlass.Numeric) else Float32(x)
    return x


def where(cond, a, b):
    a, b = _numeric(a, b), _numeric(b, a)
    if isinstance(a, cutlass.Numeric) and isinstance(b, cutlass.Numeric) and type(a) is not type(b):
        a, b = Float32(a), Float32(b)
    return type(a)(cutlass.select_(cond, a, b))


def tanh(x):
    return cute.math.tanh(Float32(x), fastmath=True)


def exp(x):
    return cute.math.exp(Float32(x), fastmath=True)


def log(x):
    return cute.math.log(Float32(x), fastmath=True)


def abs(x):  # noqa: A001
    return cute.math.abs(x)
