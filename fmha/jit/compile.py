"""Compiling a kernel object with the CuTe DSL for a chosen architecture, without a GPU.

Kernels are compiled against fake tensors (symbolic sizes and strides, static head dim) and a
fake stream, and called through TVM FFI with torch tensors: one compiled kernel serves every
size, and nothing here touches the driver.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
        torch.float8_e4m3fn: cutlass.Float8E4M3FN,
        torch.float32: cutlass.Float32,
        torch.float64: cutlass.Float64,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
        torch.int8: cutlass.Int8,
        torch.uint8: cutlass.Uint8,
    }[dtype]


@contextlib.contextmanager
def targeting(arch: str):
    """Make the DSL emit code for ``arch`` (e.g. "sm_90a") while the block runs. Without a GPU it
    would target its default; the DSL reads the target when a kernel is compiled."""
    from cutlass.cutlass_dsl import CuTeDSL

    envar = CuTeDSL._get_dsl().envar
    previous = envar.arch
    if previous == arch or (arch == "sm_90a" and previous.startswith("sm_90")):
        yield
        return
    envar.arch = arch
    try:
        yield
    finally:
        envar.arch = previous


def fake_rows(dtype, rank: int, static_last: Optional[int] = None, align_bytes: int = 16):
    """A fake tensor of ``rank`` symbolic dims whose last is contiguous (static when given) and
    whose other strides keep every row ``align_bytes``-aligned."""
    import cutlass.cute as cute

    align_elems = max(1, align_bytes * 8 // dtype.width)
    shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (
        static_last if static_last is not None else cute.sym_int(),)
    stride = tuple(cute.sym_int64(divisibility=align_elems) for _ in range(rank - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align_elems * dtype.width // 8)


def fake_vector(dtype, length=None):
    """A fake contiguous 1-D tensor (symbolic length unless given)."""
    import cutlass.cute as cute

    return cute.runtime.make_fake_tensor(dtype, (cute.sym_int() if length is None else length,), stride=(1,),
                                         assumed_align=dtype.width // 8)


def compile_for(arch: str, kernel, *args, extra_options: str = ""):
    """``cute.compile(kernel, *args, stream)`` for ``arch`` with the TVM FFI calling convention:
    the compiled function takes torch tensors and runs on the current torch stream."""
    import cutlass.cute as cute

    with targeting(arch):
        return cute.compile(kernel, *args, cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True),
                            options=("--enable-tvm-ffi " + extra_options).strip())


def fake_mod_arguments(signature) -> tuple:
    """(mod tensors, block lists) as fake tensors for a kernel built with mods ``signature``:
    any sizes and strides (a broadcast block mask has stride 0), the innermost stride 1 where the
    signature says the tensor has it."""
    import cutlass.cute as cute

    if signature is None:
        return None, None

    def fake(dtype, rank, unit_inner=False):
        strides = tuple(cute.sym_int64() for _ in range(rank - 1)) + ((1 if unit_inner else cute.sym_int64(),)
                                                                     if rank else ())
        return cute.runtime.make_fake_tensor(cutlass_dtype(dtype), tuple(cute.sym_int() for _ in range(rank)),
                                             stride=strides, assumed_align=max(1, dtype.itemsize))

    tensors = tuple(fake(*entry) for entry in signature.tensors) or None
    lists = (fake(torch.int32, 4), fake(torch.int32, 4)) if signature.block_sparse else None
    return tensors, lists
