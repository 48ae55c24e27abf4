"""Checks on the Blackwell kernel's machine code (SASS), compiled for sm_100a without a GPU by the
DSL's own ptxas and disassembled with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel of the test
extras). What the design needs to see in the instructions:

- the GEMMs are ``tcgen05`` MMAs (UTCHMMA for 16-bit inputs, UTCQMMA for fp8), S and O live in
  tensor memory (LDTM / STTM), Q, K and V arrive by TMA (UTMALDG) and dense O leaves by TMA
  (UTMASTG); TMEM is allocated and freed (UTCATOMSWS / the dealloc);
- nothing spills to local memory (no LDL / STL);
- ``setmaxnreg`` gives each role the budget the configuration sets, and ptxas's register count
  for the kernel fits 512 threads in the register file.

Four configurations by default; ``FMHA_BLACKWELL_FULL_MATRIX=1`` checks every (dtype, head dim,
mask, dense/varlen) configuration (slow).
"""

import functools
import itertools
import os
import re
import struct
import subprocess

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.blackwell import config as bc  # noqa: E402
from lab.machine_code import find_nvdisasm  # noqa: E402
from test_compile_blackwell import _PAIRS, KINDS, blackwell_config, compiled_cubin  # noqa: E402

NVDISASM = find_nvdisasm()
pytestmark = pytest.mark.skipif(NVDISASM is None, reason="needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
FP8 = torch.float8_e4m3fn

# configurations the compile test builds too (its cubins are reused)
CONFIGS = {
    "bf16-d128-causal": dict(dtype=torch.bfloat16, head_dim=128, mask="causal", persistent=False),
    "fp16-d64-causal": dict(dtype=torch.float16, head_dim=64, mask="causal", persistent=False),
    "fp8-d128-causal-fp8out": dict(dtype=FP8, head_dim=128, mask="causal", out_dtype=FP8),
    "bf16-d128-varlen-window": dict(dtype=torch.bfloat16, head_dim=128, mask="window", varlen=True, lse=False,
                                    out_dtype=torch.float16),
}
if os.environ.get("FMHA_BLACKWELL_FULL_MATRIX") == "1":
    CONFIGS = {f"{dt}-d{d}-{m}-{'varlen' if vl else 'dense'}".replace("torch.", ""):
               dict(dtype=dt, head_dim=d, mask=m, varlen=vl)
               for (dt, d), m, vl in itertools.product(_PAIRS, KINDS, (False, True))}


@functools.lru_cache(maxsize=None)
def _build(name):
    """(configuration, SASS text, {symbol index: ptxas register count}) of configuration ``name``."""
    cfg = blackwell_config(**CONFIGS[name])
    cubin = compiled_cubin(cfg)
    sass = subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True, check=True).stdout
    return cfg, sass, _register_counts(open(cubin, "rb").read())


def _register_counts(elf: bytes) -> dict:
    """Per-kernel register counts from a cubin's ``.nv.info`` (attribute EIATTR_REGCOUNT, 0x2f:
    symbol index, count), keyed by symbol index."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]
    counts = {}
    for sec in sections:
        name = elf[names_at + sec[0]:elf.index(b"\0", names_at + sec[0])]
        if name != b".nv.info":
            continue
        p, end = sec[4], sec[4] + sec[5]
        while p < end:
            fmt, attr = elf[p], elf[p + 1]
            if fmt == 4:  # EIFMT_SVAL: a 16-bit size, then the value
                size, = struct.unpack_from("<H", elf, p + 2)
                if attr == 0x2F:
                    symbol, count = struct.unpack_from("<II", elf, p + 4)
                    counts[symbol] = count
                p += 4 + size
            elif fmt == 1:  # EIFMT_NVAL
                p += 2
            else:  # EIFMT_BVAL / HVAL
                p += 4
    return counts


def _count(sass: str, opcode: str) -> int:
    return len(re.findall(rf"\b{re.escape(opcode)}\b", sass))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tcgen05_tmem_and_tma_instructions(name):
    cfg, sass, _ = _build(name)
    mma = "UTCQMMA" if cfg.dtype == FP8 else "UTCHMMA"
    other = "UTCHMMA" if cfg.dtype == FP8 else "UTCQMMA"
    assert _count(sass, mma) >= 2 and _count(sass, other) == 0  # Q K^T and P V
    assert _count(sass, "LDTM") >= 3 and _count(sass, "STTM") >= 2  # S, statistics, O / P, statistics
    assert _count(sass, "UTMALDG") >= 3  # Q, K, V
    assert (_count(sass, "UTMASTG") >= 1) == cfg.o_via_tma  # O by TMA, except varlen
    assert _count(sass, "UTCATOMSWS") >= 1  # the TMEM allocation


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_local_memory_spills(name):
    _, sass, _ = _build(name)
    spills = [line.strip() for line in sass.splitlines() if re.search(r"\b(LDL|STL)(\.\w+)*\b", line)]
    assert not spills, f"{len(spills)} local-memory accesses, e.g. {spills[:3]}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_register_budgets(name):
    """The softmax warpgroups raise their budget to REGISTERS_SOFTMAX, the correction warpgroup
    and the single warps lower theirs; ptxas's count for the whole kernel is what 512 threads
    may hold (128), and no other count appears (the varlen descriptor kernel's is its own)."""
    _, sass, regs = _build(name)
    alloc = {int(v, 16) for v in re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL\s+\w+,\s*(0x[0-9a-f]+)", sass)}
    dealloc = {int(v, 16) for v in re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL\s+(0x[0-9a-f]+)", sass)}
    assert alloc == {bc.REGISTERS_SOFTMAX}
    assert dealloc == {bc.REGISTERS_CORRECTION, bc.REGISTERS_OTHER}
    assert regs and max(regs.values()) <= 65536 // 512
