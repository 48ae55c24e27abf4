"""Views of warpgroup-MMA register fragments.

A Hopper ``wgmma`` accumulator fragment has the per-thread shape ``((2, 2, V), M, N)``: two
adjacent columns, two rows eight apart, and ``V`` column groups eight apart, repeated over the
MMA tiles in M and N. The softmax wants it as a (rows, columns) matrix, and the P.V product wants
the same registers as its A operand. Both are only re-indexings of the same registers, so they
cost nothing at run time.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def _rows_cols_layout(acc_layout: cute.Layout) -> cute.Layout:
    # Work on the compact layout of the same shape: fragment registers are numbered
    # column-major over ((2, 2, V), M, N); regroup that numbering, then compose.
    compact = cute.make_layout(acc_layout.shape)
    shp, std = compact.shape, compact.stride
    regrouped = cute.make_layout(
        ((shp[0][1], shp[1]), (shp[0][0], shp[0][2], shp[2])),
        stride=((std[0][1], std[1]), (std[0][0], std[0][2], std[2])),
    )
    return cute.composition(acc_layout, regrouped)


def as_rows_cols(frag: cute.Tensor) -> cute.Tensor:
    """``((2, 2, V), M, N)`` -> ``((2, M), (2, V, N))``: index [row, col] of this thread's part."""
    return cute.make_tensor(frag.iterator, _rows_cols_layout(frag.layout))


def _operand_a_layout(acc_layout: cute.Layout) -> cute.Layout:
    # A 16-bit A-operand k-block of 16 columns is two 8-column groups of the accumulator; split V
    # into (2, V / 2) and move the V / 2 factor next to the MMA's K repetition.
    split = cute.logical_divide(acc_layout, ((None, None, 2), None, None))
    shp, std = split.shape, split.stride
    return cute.make_layout(
        ((shp[0][0], shp[0][1], shp[0][2][0]), shp[1], (shp[0][2][1], shp[2])),
        stride=((std[0][0], std[0][1], std[0][2][0]), std[1], (std[0][2][1], std[2])),
    )


def as_operand_a(frag: cute.Tensor) -> cute.Tensor:
    """View an accumulator-shaped fragment (already converted to 16-bit) as the register A
    operand ``((2, 2, 2), M, K_blocks)`` of the next warpgroup MMA."""
    return cute.make_tensor(frag.iterator, _operand_a_layout(frag.layout))


def fp8_operand_a_shape(acc_shape) -> tuple:
    """Register shape of the fp8 P fragment for an accumulator of shape ``((2, 2, V), M, N)``:
    ``(((2, 2), 2, 2), M, (V / 4, N))``; mode 2 enumerates the 32-key blocks."""
    (c2, r2, v), m, n = acc_shape
    assert c2 == 2 and r2 == 2 and v % 4 == 0, acc_shape
    return (((2, 2), 2, 2), m, (v // 4, n))


def as_operand_a_fp8(acc: cute.Tensor) -> cute.Tensor:
    """View of an fp32 accumulator in the order of ``fp8_operand_a_shape``: element (((p, i1),
    r, h), m, (kb, n)) is the accumulator's ((p, r, 4 kb + 2 h + i1), m, n). Converting this view
    element-wise into a compact fp8 tensor of that shape yields the A operand directly."""
    compact = cute.make_layout(acc.layout.shape)
    shp, std = compact.shape, compact.stride
    c2, r2, v = std[0]
    view = cute.make_layout(
        (((2, 2), 2, 2), shp[1], (shp[0][2] // 4, shp[2])),
        stride=(((c2, v), r2, 2 * v), std[1], (4 * v, std[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


def ptx_b32(text: str, constraints: str, operands: list, *, loc=None, ip=None):
    """One PTX instruction with a 32-bit register result (``$0``), as inline assembly: for the
    conversions and shifts whose PTX semantics the DSL's own ops do not give."""
    return llvm.inline_asm(
        T.i32(),
        [x.ir_value(loc=loc, ip=ip) for x in operands],
        text,
        constraints,
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def _pack_pair(lo: Float32, hi: Float32, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one packed 16-bit pair (``lo`` in the low half)."""
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(ptx_b32(f"cvt.rn.{kind}.f32 $0, $1, $2;", "=r,f,f", [Float32(hi), Float32(lo)],
                         loc=loc, ip=ip))


@cute.jit
def store_as_16bit_pairs(dst: cute.Tensor, src: cute.Tensor):
    """``dst`` (a 16-bit fragment) = ``src`` (fp32, same layout), written as packed 32-bit
    words. A register-A ``wgmma`` reads 32-bit registers: when the values live as separate 16-bit
    halves (the element-wise conversion the DSL emits for key tiles that are not a power of two,
    e.g. 80 at D=256), the packing lands after ``wgmma.fence``, and ptxas then serializes the
    P.V MMAs (advisory C7519) and waits for them before the softmax."""
    words = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(words)):
        words[i] = _pack_pair(src[2 * i], src[2 * i + 1], dst.element_type is cutlass.BFloat16)
