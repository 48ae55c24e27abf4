"""Checks on the Hopper kernel's machine code (SASS), compiled without a GPU by the DSL's own
ptxas and disassembled with ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel of the test extras).

They pin scheduling properties that PTX cannot show and that the H200 profiles traced
(docs/archive/performance-history.md, item 13):
- the consumer's S-GEMM issue reads its Q descriptor from uniform registers, without ``R2UR``
  moves inside the K/V loop;
- in the overlapped loop, most of the softmax's exponentials run before the wait for the
  previous tile's P.V GEMM (``WARPGROUP.DEPBAR.LE gsb0, 0x0``), not after it;
- masked K/V tiles test one bit per score, which ptxas turns into ``R2P`` (7 predicates per
  instruction), instead of two integer compares per score.

And of the backward kernel, what its ncu profile traced (results/archive.tar.xz: profile/backward_s4k/):
no registers in local memory and no global loads of the LSE and delta on the consumers' path,
and the exponentials overlapping the dP product.
"""

import functools
import os
import re
import subprocess

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.hopper.forward_runner import compile_forward as compile_kernel  # noqa: E402
from fmha.kernels.hopper.config import OStore  # noqa: E402
from kernel_configs import library_config  # noqa: E402

from lab.machine_code import find_nvdisasm  # noqa: E402

NVDISASM = find_nvdisasm()
pytestmark = pytest.mark.skipif(NVDISASM is None, reason="needs nvdisasm (pip install nvidia-cuda-nvdisasm)")


def _config(head_dim, causal, seqlen=16384):
    return library_config(torch.bfloat16, head_dim, "causal" if causal else "none", lse=False, seqlen_k=seqlen)


def _disassembly(compile_fn, cfg, out: str) -> str:
    """The SASS of ``compile_fn(cfg)``, its cubin kept in the directory ``out``."""
    os.makedirs(out, exist_ok=True)
    compile_fn(cfg, extra_options=f"--keep-cubin --dump-dir={out}")
    cubin = next(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".cubin"))
    return subprocess.run([NVDISASM, "-c", cubin], capture_output=True, text=True, check=True).stdout


@functools.lru_cache(maxsize=None)
def _sass(cfg, tmp_root):
    return _disassembly(compile_kernel, cfg, os.path.join(tmp_root, f"k{abs(hash(cfg))}"))


def _instructions(sass: str) -> tuple:
    """(the instructions in order, label -> index of the instruction it precedes)."""
    ins, labels = [], {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ins)
        elif m := re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line):
            ins.append(m.group(1))
    return ins, labels


def _innermost_wgmma_loops(ins, labels) -> list:
    """(first, last) instruction of each loop (a backward branch to a label) that issues wgmma
    and holds no smaller such loop."""
    loops = []
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s+`\((\.L_x_\d+)\)", text)
        if m and labels.get(m.group(1), i + 1) <= i and any("HGMMA" in t for t in ins[labels[m.group(1)]:i]):
            loops.append((labels[m.group(1)], i))
    return [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]


def _mainloops(cfg, tmp_root) -> list:
    """Instruction lists of the K/V loops: the innermost loops that issue wgmma (the whole tile
    loop holds them; the barrier-wait spins inside them issue none)."""
    ins, labels = _instructions(_sass(cfg, tmp_root))
    inner = _innermost_wgmma_loops(ins, labels)
    assert inner, "no K/V loop with wgmma found"
    return [ins[s:e + 1] for s, e in inner]


CONFIGS = [(64, False), (128, False), (128, True), (256, False)]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sass"))


@pytest.mark.parametrize("head_dim,causal", CONFIGS)
def test_q_descriptor_needs_no_r2ur(head_dim, causal, tmp_root):
    """Without ``make_warp_uniform`` on the warpgroup index, every S-GEMM wgmma of the loop waited
    on two R2UR moves of its Q descriptor: 16 per K/V tile at D=128, 8 at D=64. (At D=256 ptxas
    keeps the K/V stage index in an ordinary register: one R2UR per GEMM, 2 per tile.)"""
    for body in _mainloops(_config(head_dim, causal), tmp_root):
        assert len([t for t in body if re.match(r"(@!?U?P\d\s+)?R2UR\b", t)]) <= 2


@pytest.mark.parametrize("head_dim", [64, 128])
def test_tma_store_epilogue_keeps_the_stage_index_uniform(head_dim, tmp_root):
    """The TMA-store epilogue issues from a warp-uniform branch. Branching on the thread index
    there instead (one thread issues) made ptxas move the K/V stage index of the mainloop into
    ordinary registers at D=64: two R2UR per K/V tile, each on the path to a wgmma. (With the
    LSE written as well, ptxas still does so at D=64: docs/archive/performance-history.md, item 16.)"""
    cfg = _config(head_dim, False, seqlen=2048)
    assert cfg.o_via_tma and not cfg.has_lse
    for body in _mainloops(cfg, tmp_root):
        assert not [t for t in body if re.match(r"(@!?U?P\d\s+)?R2UR\b", t)]


@pytest.mark.parametrize("head_dim,causal", CONFIGS)
def test_exponentials_run_before_the_pv_wait(head_dim, causal, tmp_root):
    """Released before the softmax, K's mbarrier arrive let ptxas hoist the P.V wait to the first
    row max (0-18 of 66 exponentials before it at D=128); ``release_by_one_lane`` with an anchor
    keeps it below."""
    steps = 0
    for body in _mainloops(_config(head_dim, causal), tmp_root):
        waits_s = [i for i, t in enumerate(body) if "DEPBAR.LE gsb0, 0x1" in t]
        if not waits_s:
            continue  # a loop with no P.V in flight during its softmax
        wait_pv = next(i for i, t in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in t and i > waits_s[0])
        exps = [i for i, t in enumerate(body) if "MUFU.EX2" in t]
        before = sum(waits_s[0] < i < wait_pv for i in exps)
        assert before >= len(exps) / 2, f"{before} of {len(exps)} exponentials before the P.V wait"
        steps += 1
    assert steps, "no overlapped step found"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_masked_tiles_use_r2p(head_dim, tmp_root):
    """With two compares per score the masked loops had no R2P and 2-3 integer instructions per
    score (67 ISETP + 28 VIADD at D=128); with ``kept_column_bits`` they have R2P, and the masked
    loop is 604 instead of 657 instructions at D=128."""
    loops = _mainloops(_config(head_dim, True), tmp_root)
    masked = [b for b in loops if sum("FSEL" in t for t in b) >= 32]
    assert masked, "no masked K/V loop found"
    for body in masked:
        assert sum(t.startswith("R2P") or " R2P " in t for t in body) >= 4
        assert sum(re.match(r"(@!?P\d\s+)?ISETP", t) is not None for t in body) < 16


def _backward_sass(head_dim, causal, tmp_root, **variant) -> tuple:
    """The backward kernel's instructions (dense bf16) in order, and its labels; ``variant``:
    overrides of its config (``lab.variants``)."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.masking import MaskKind
    from lab.variants import backward_variant_config

    cfg = HopperBackwardConfig(torch.bfloat16, head_dim, MaskKind.WINDOW if causal else MaskKind.NONE, False, causal,
                               False)
    if variant:
        cfg = backward_variant_config(cfg, **variant)
    out = os.path.join(tmp_root, f"bwd{head_dim}{int(causal)}" + "".join(f"_{k}{v}" for k, v in variant.items()))
    return _instructions(_disassembly(compile_backward, cfg, out))


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_backward_keeps_its_registers_and_reads_row_statistics_from_shared_memory(head_dim, causal, tmp_root):
    """With the LSE and delta loaded from global memory into 32 registers per thread, D=128 kept 3
    registers in local memory (3.2 million requests at S=4k) and the exponentials waited on the
    loads (7-12% of the stall samples); TMA brings them to shared memory with Q and dO now, and
    each column's value is read where it is used (D=128's LSE while the S and dP products run)."""
    ins, labels = _backward_sass(head_dim, causal, tmp_root)
    spills = [i for i, t in enumerate(ins) if re.search(r"\b(LDL|STL)\b", t)]
    # D=128 with a mask keeps a few (7 loads and stores, from 38 with the statistics held in
    # registers): a ratchet, so that it does not grow unnoticed; D=64 keeps every register since dS^T
    # is stored before dV's product (it kept 8 without a mask, 3 causal, one reloaded per query tile)
    assert len(spills) <= (10 if head_dim == 128 and causal else 0)
    if head_dim == 64:  # the query-tile loop (the shortest loop that issues wgmma)
        first, last = min(_innermost_wgmma_loops(ins, labels), key=lambda loop: loop[1] - loop[0])
        # it is the query-tile loop: a thread's 64 exponentials of P^T (64 keys x 128 rows)
        assert sum("MUFU.EX2" in t for t in ins[first:last + 1]) == 64
    assert not [t for t in ins if re.search(r"\bLDG\b", t)]
    assert sum("LDS" in t for t in ins) >= 16  # the row statistics, read where they are used


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_exponentials_overlap_the_dp_product(head_dim, tmp_root):
    """S^T and dP^T are issued back to back; the exponentials of P^T run after the wait for S^T
    (``DEPBAR.LE gsb0, 0x1``) and before the wait for dP^T, not after both."""
    ins, _ = _backward_sass(head_dim, False, tmp_root)
    exps = [i for i, t in enumerate(ins) if "MUFU.EX2" in t]
    assert exps
    wait_s = max(i for i, t in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in t and i < exps[0])
    wait_dp = min(i for i, t in enumerate(ins) if "DEPBAR.LE gsb0, 0x0" in t and i > wait_s)
    assert sum(wait_s < i < wait_dp for i in exps) == len(exps)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_lse_loads_run_under_the_s_product_at_d128(causal, tmp_root):
    """At D=128 the tile's LSE columns (16 per thread) are loaded from shared memory between the
    issue of S^T and dP^T and the wait for S^T: loaded at their use, the exponentials waited on
    them (ncu, D=128 S=1k causal: 5% of the stall samples on their FFMAs, FA4's 1%)."""
    ins, _ = _backward_sass(128, causal, tmp_root)
    first_exp = min(i for i, t in enumerate(ins) if "MUFU.EX2" in t)
    wait_s = max(i for i, t in enumerate(ins) if "DEPBAR.LE gsb0, 0x1" in t and i < first_exp)
    start = wait_s  # back to the wait for the Q/dO stage: the stretch that issues both products
    while not re.search(r"\b(SYNCS|BRA|BAR|DEPBAR)\b", ins[start - 1]):
        start -= 1
    assert sum("HGMMA" in t for t in ins[start:wait_s]) >= 8
    loaded = sum(2 if "LDS.64" in t else 1 for t in ins[start:wait_s] if t.startswith("LDS"))
    assert loaded >= 16


def test_backward_stages_dk_while_dv_is_stored(tmp_root):
    """D=128 stores dV and dK through the freed V and K buffers; dK is staged (``STSM``) while
    dV's TMA store still reads V's buffer: no wait for the bulk store (``DEPBAR.LE SB0``) between
    them (ncu, D=128 S=1k causal: 3.5% of the stall samples on that wait; FA4 keeps it in flight)."""
    ins, _ = _backward_sass(128, True, tmp_root)
    dv_store = min(i for i, t in enumerate(ins) if t.startswith("UTMASTG"))
    dk_staged = min(i for i, t in enumerate(ins) if t.startswith("STSM") and i > dv_store)
    assert not [t for t in ins[dv_store:dk_staged] if "DEPBAR.LE SB0" in t]
    assert [t for t in ins[dk_staged:] if "DEPBAR.LE SB0, 0x0" in t]  # the stores are drained before exit


@pytest.mark.parametrize("head_dim", [64, 128])
def test_backward_dq_fragments_stage_with_16_byte_stores(head_dim, tmp_root):
    """The dQ accumulator in the fragments' order (``dq_layout.py``): a thread stages its 32 dQ
    values as 8 conflict-free 16-byte stores (the row-major tile took 16 8-byte ones) and the
    writer adds each warpgroup's block with one bulk reduce (``UBLKRED``) instead of a TMA tile
    reduce (``UTMAREDG``)."""
    ins, _ = _backward_sass(head_dim, False, tmp_root)
    assert sum("STS.128" in t for t in ins) == 8 and not any("STS.64" in t for t in ins)
    assert sum("UBLKRED" in t for t in ins) == 2 and not any("UTMAREDG" in t for t in ins)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_80_row_tile_keeps_its_registers(causal, tmp_root):
    """D=128 from ``LONG_ROWS`` query rows without a mask (and variant ``fmha_bwd_m80`` everywhere):
    80 query rows per step, S^T and dP^T as 64x80 MMAs, dQ^T
    over 128 keys as 64x80 MMAs and dV/dK over the 80 rows as 64x128 ones, every register kept
    (S^T, dP^T and dQ^T hold 40 values per thread beside dK/dV's 128), dQ^T staged as 10 16-byte
    stores."""
    ins, _ = _backward_sass(128, causal, tmp_root, tile_m=80)
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    assert sum("HGMMA.64x80x16" in t for t in ins) == 3 * 8 and sum("HGMMA.64x128x16" in t for t in ins) == 2 * 5
    assert sum("MUFU.EX2" in t for t in ins) == 40 and sum("STS.128" in t for t in ins) == 10


@pytest.mark.parametrize("head_dim,causal", [(64, False), (64, True), (128, False), (128, True)])
def test_backward_stores_ds_before_the_dv_product(head_dim, causal, tmp_root):
    """dS^T goes to shared memory before the first of dV's MMAs of the query tile is issued (the
    fence after the stores then waits for less), and the stores cost no register: none is kept in
    local memory at D=64 (the row-major dQ tile's kernel spilled so)."""
    ins, labels = _backward_sass(head_dim, causal, tmp_root)
    if head_dim == 64:
        assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    first, last = min(_innermost_wgmma_loops(ins, labels), key=lambda loop: loop[1] - loop[0])
    loop = ins[first:last + 1]
    stsm = [i for i, t in enumerate(loop) if t.startswith("STSM")]
    dkv = [i for i, t in enumerate(loop) if f"HGMMA.64x{head_dim}x16" in t]  # dV's and dK's
    assert stsm and dkv and max(stsm) < min(dkv)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_d256_splits_the_head_dim_and_keeps_its_registers(causal, tmp_root):
    """D=256 (``split_head_dim``): per 64-row query tile each warpgroup issues S^T and dP^T over its
    32 query columns (16 64x32 MMAs each, over the head dim), then dV, dK and dQ over its half of
    the head dim (4 64x128 MMAs each, over 64 queries or keys) from P^T and dS^T in shared memory
    (two stmatrix groups); dK and dV (64 + 64 values) stay in registers beside dQ's 64, none in
    local memory; 16 exponentials per thread and tile. The order that the one Q/dO stage's reuse
    depends on is pinned too (docs/design.md); that dS^T alternates between two buffers is not
    visible here (the GPU cases' GQA shapes with odd tile counts carry it across heads)."""
    ins, labels = _backward_sass(256, causal, tmp_root)
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    first, last = min(_innermost_wgmma_loops(ins, labels), key=lambda loop: loop[1] - loop[0])
    loop = ins[first:last + 1]
    assert sum("HGMMA.64x32x16" in t for t in loop) == 2 * 16
    assert sum("HGMMA.64x128x16" in t for t in loop) == 3 * 4
    assert sum("MUFU.EX2" in t for t in loop) == 16
    # P^T is stored before the wait for dP^T, dS^T after it and before the barrier that dV's
    # product waits on
    stsm = [i for i, t in enumerate(loop) if t.startswith("STSM")]
    dkv = [i for i, t in enumerate(loop) if "HGMMA.64x128x16" in t]
    wait_dp = min(i for i, t in enumerate(loop) if "DEPBAR.LE gsb0, 0x0" in t)
    assert len(stsm) >= 4 and max(stsm) < min(dkv)
    assert min(stsm) < wait_dp < max(stsm)
    # the Q/dO stage is released (the empty barrier's arrive) once dV and dK are done and before
    # dQ's product is waited on and staged: the next tile's loads run under dQ
    after = loop[max(dkv):]
    wait_dkv = next(i for i, t in enumerate(after) if "DEPBAR.LE gsb0, 0x1" in t)
    release = next(i for i, t in enumerate(after) if "SYNCS.ARRIVE" in t)
    wait_dq = next(i for i, t in enumerate(after) if "DEPBAR.LE gsb0, 0x0" in t)
    staged = next(i for i, t in enumerate(after) if "STS.128" in t)
    assert wait_dkv < release < wait_dq < staged
    assert sum("UBLKRED" in t for t in ins) == 2 and sum("STS.128" in t for t in ins) == 16


@pytest.mark.parametrize("name", ["fmha_fp8_d256_n64", "fmha_fp8_d256_n96"])
def test_fp8_key_tile_variants_fit_and_keep_their_registers(name, tmp_root):
    """The lab variants with other fp8 key tiles at D=256 (``lab/variants.py``) fit shared memory
    beside O's buffer (the forward's trace raises otherwise) and keep every register, as
    production's 128-key tile does: a variant that spilled would time its spills, not its tile.
    The S GEMM is 64 x tile_n per warpgroup."""
    from lab.variants import VARIANTS, variant_config

    overrides = dict(VARIANTS[name])
    (head_dim,) = overrides.pop("head_dims")
    overrides.pop("fp8_only")
    base = library_config(torch.float8_e4m3fn, head_dim, "none", lse=False, seqlen_k=8192)
    assert (base.tile_n, base.kv_stages, base.o_store) == (128, 4, OStore.TMA_OWN_BUFFER)
    cfg = variant_config(base, **overrides)
    assert cfg.tile_n == overrides["tile_n"] and cfg.kv_stages == {64: 8, 96: 5}[cfg.tile_n]
    for c in (base, cfg):
        ins, _ = _instructions(_sass(c, tmp_root))
        assert any(f"QGMMA.64x{c.tile_n}x32.F32.E4M3.E4M3" in t for t in ins)
        assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]


#: head dims beyond 32/64/128/256 and V's head dim unlike Q's: (D, D_v, causal)
NEW_HEAD_DIMS = [(96, 96, True), (192, 128, False), (192, 192, True), (128, 64, False), (48, 48, False)]


@pytest.mark.parametrize("head_dim,head_dim_v,causal", NEW_HEAD_DIMS)
def test_new_head_dims_keep_their_registers_and_overlap(head_dim, head_dim_v, causal, tmp_root):
    """The forward at the new head dims: warpgroup MMAs and TMA loads, no registers in local
    memory, and the softmax's exponentials under the previous tile's P.V as at D=128."""
    cfg = library_config(torch.bfloat16, head_dim, "causal" if causal else "none", lse=False, seqlen_k=16384,
                         head_dim_v=head_dim_v)
    assert (cfg.head_dim, cfg.head_dim_v) == (head_dim, head_dim_v)
    sass = _sass(cfg, tmp_root)
    assert "HGMMA" in sass and "UTMALDG" in sass
    ins, _ = _instructions(sass)
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    for body in _mainloops(cfg, tmp_root):
        waits_s = [i for i, t in enumerate(body) if "DEPBAR.LE gsb0, 0x1" in t]
        if waits_s:
            wait_pv = next(i for i, t in enumerate(body) if "DEPBAR.LE gsb0, 0x0" in t and i > waits_s[0])
            exps = [i for i, t in enumerate(body) if "MUFU.EX2" in t]
            assert sum(waits_s[0] < i < wait_pv for i in exps) >= len(exps) / 2


@pytest.mark.parametrize("head_dim", [96, 192])
def test_backward_new_head_dims_keep_their_registers(head_dim, tmp_root):
    """The backward at D=96 (64 keys per warpgroup, dQ by halves of the head dim of 48 columns)
    and D=192 (the head dim split between the warpgroups, 96 columns each): no registers in local
    memory, and the MMAs over each half: 64x48 for dQ at 96, 64x96 for dV, dK and dQ at 192."""
    ins, labels = _backward_sass(head_dim, True, tmp_root)
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    half = head_dim // 2
    first, last = min(_innermost_wgmma_loops(ins, labels), key=lambda loop: loop[1] - loop[0])
    assert any(f"HGMMA.64x{half}x16" in t for t in ins[first:last + 1])


@pytest.mark.parametrize("group,head_dim,head_dim_v,select_block", [(16, 128, 128, 64), (4, 128, 128, 32),
                                                                     (2, 64, 64, 64), (8, 192, 128, 16)])
def test_the_selection_kernel_loads_any_key_row_and_keeps_its_registers(group, head_dim, head_dim_v, select_block,
                                                                          tmp_root):
    """NSA's selection kernel (``config.selection_config``): 64x64 score tiles on the tensor
    cores, K and V TMA-loaded from the key row each entry names (a block starts where its
    sequence does), no registers in local memory."""
    from fmha.kernels.hopper.config import selection_config

    cfg = selection_config(torch.bfloat16, head_dim, head_dim_v, group, select_block)
    ins, _ = _instructions(_sass(cfg, tmp_root))
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    assert any("HGMMA.64x64x16" in t for t in ins) and any("UTMALDG" in t for t in ins)


@pytest.mark.parametrize("dtype,head_dim,head_dim_v,group", [(torch.bfloat16, 128, 128, 16), (torch.float16, 64, 64, 4),
                                                             (torch.bfloat16, 128, 64, 2), (torch.bfloat16, 96, 96, 8),
                                                             (torch.bfloat16, 64, 64, 4), (torch.float16, 64, 128, 16)])
def test_the_selection_backward_keeps_its_registers(dtype, head_dim, head_dim_v, group, tmp_root):
    """NSA's selection backward (``bwd_config.selection_backward_config``): the varlen backward
    over listed K/V tiles, each warpgroup's keys masked by its visit's positions; no registers in
    local memory, the products on the tensor cores (S^T and dP^T 64 keys by the query tile: 16
    rows at D=128 up to groups of 16), split lists' dK and dV added by fp32 reductions, none where
    lists are never split (``list_pieces=1``)."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import selection_backward_config

    for split in (True, False):
        cfg = selection_backward_config(dtype, head_dim, head_dim_v, group, list_pieces=None if split else 1)
        out = os.path.join(tmp_root, f"selbwd{head_dim}_{head_dim_v}_{group}_{split}")
        ins, _ = _instructions(_disassembly(compile_backward, cfg, out))
        assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
        assert any(f"HGMMA.64x{cfg.tile_m}x16" in t for t in ins)
        reductions = sum(t.startswith("REDG.E.ADD.F32") for t in ins)
        assert cfg.tile_m == (max(16, group) if head_dim == 128 else 128 if head_dim == head_dim_v == 64 else 64)
        if split:
            assert cfg.list_pieces > 1 and reductions >= (head_dim + head_dim_v) // 2
        else:
            assert reductions == 0


@pytest.mark.parametrize("dtype,head_dim,group,geometry", [(torch.bfloat16, 128, 16, (32, 16, 64, 16)),
                                                           (torch.bfloat16, 64, 1, (16, 8, 32, 5)),
                                                           (torch.float16, 192, 2, (64, 32, 32, 32)),
                                                           (torch.bfloat16, 96, 8, (64, 64, 64, 1)),
                                                           (torch.bfloat16, 64, 64, (32, 16, 64, 3))])
def test_the_topk_kernel_scores_on_the_tensor_cores_and_keeps_its_registers(dtype, head_dim, group, geometry,
                                                                            tmp_root):
    """NSA's fused top-k (``kernels/common/block_topk.py``): the scores by warp MMAs, their
    probabilities summed per token in registers and shared memory, no registers in local memory."""
    from fmha.kernels.common.block_topk import BlockTopKConfig
    from fmha.kernels.hopper.topk_runner import compile_block_topk

    cfg = BlockTopKConfig(dtype, head_dim, group, *geometry, score_capacity=1024)
    ins, _ = _instructions(_disassembly(compile_block_topk, cfg, os.path.join(tmp_root, f"topk{abs(hash(cfg))}")))
    assert not [t for t in ins if re.search(r"\b(LDL|STL)\b", t)]
    assert any(t.startswith("HMMA.16816.F32") for t in ins)
    # a token of at most 16 rows is summed within its warp: plain shared stores, no atomics
    assert any(t.startswith("ATOMS") for t in ins) == (group > 16)
