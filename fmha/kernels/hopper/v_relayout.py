"""The byte transpose behind fp8 V's key-major layout: four 32-bit words, one per key, become
four words, one per head-dim byte, with byte permutes (``prmt``). The staging kernel
(``v_transpose.StageVKernel``, behind ``v_staging.stage_v_fp8``) applies it to each slot word of
a block of 32 keys.

Plain arithmetic over a ``prmt`` passed in, so it runs on the kernel's ``Int32`` values and, with
a model of ``prmt``, on Python ints.
"""


def transpose_4x4_bytes(prmt, a, b, c, d):
    """Four words of 4 bytes each (one per key) -> four words, word j holding byte j of a, b, c,
    d; ``prmt`` is ``cute.arch.prmt`` (or a model of it)."""
    ab_lo, ab_hi = prmt(a, b, 0x5140), prmt(a, b, 0x7362)  # a0 b0 a1 b1 | a2 b2 a3 b3
    cd_lo, cd_hi = prmt(c, d, 0x5140), prmt(c, d, 0x7362)
    return (prmt(ab_lo, cd_lo, 0x5410), prmt(ab_lo, cd_lo, 0x7632),
            prmt(ab_hi, cd_hi, 0x5410), prmt(ab_hi, cd_hi, 0x7632))
