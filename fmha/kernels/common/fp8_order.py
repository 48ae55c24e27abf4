"""The key order of the fp8 P.V product, shared by the kernels and the host-side V staging (plain
Python: importing it does not import the DSL)."""

# fp8 A operand. Per block of 32 keys a thread (lane t of its row's quad) holds in registers
# a0..a3 = (row g, keys 4t..4t+3), (row g+8, same), (row g, keys 16+4t..), (row g+8, same); the
# fp32 accumulator gives it keys 8v + 2t + {0, 1} for v = 0..3 instead. Feeding slot
# (i, row, h) of the A operand from accumulator column v = 2h + i // 2, pair element i % 2, keeps
# every value in its thread; slot j = 16h + 4t + i then stands for key FP8_KEY_ORDER[j], and V is
# staged with its keys in that order (fmha/kernels/hopper/v_staging.py).
FP8_KEY_ORDER = tuple(
    16 * h + 8 * (i // 2) + 2 * t + i % 2 for h in range(2) for t in range(4) for i in range(4)
)
#: keys per block of the fp8 P.V product
FP8_KEY_BLOCK = len(FP8_KEY_ORDER)
