"""Compile the Hopper kernel for sm_90a without a GPU (fake tensors, TVM FFI environment stream)
and check that the machine code has warpgroup MMAs and TMA loads: a change that breaks
compilation fails here, in CI.

Coverage: every mask kind and both scheduling modes for every (input dtype, head dim) pair
(rotating the mask so each pair meets two kinds and each kind meets every pair), plus varlen
with bottom-right alignment, no LSE and a different output dtype for each pair."""

import itertools
import re

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.hopper.forward_runner import compile_forward as compile_kernel  # noqa: E402
from fmha.kernels.hopper.config import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, OStore, Schedule  # noqa: E402
from kernel_configs import library_config  # noqa: E402

from lab.variants import BACKWARD_VARIANTS, backward_variant_config  # noqa: E402

FP8 = torch.float8_e4m3fn


def _config(dtype, head_dim, mask, persistent, varlen=False, lse=True, out_dtype=None, tile=None):
    """The kernel the library builds for these choices at 1k keys."""
    return library_config(dtype, head_dim, mask, persistent, varlen, lse, out_dtype, tile)


_PAIRS = list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS))
_KINDS = ["none", "causal", "window", "compressed_causal"]
_MAIN = [(dt, d, _KINDS[(i + j) % 4], bool(j)) for i, (dt, d) in enumerate(_PAIRS) for j in range(2)]


@pytest.mark.parametrize("dtype,head_dim,mask,persistent", _MAIN,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_compiles(dtype, head_dim, mask, persistent):
    assert compile_kernel(_config(dtype, head_dim, mask, persistent)) is not None


def test_every_mask_kind_meets_every_dtype_and_head_dim_slot():
    assert {m for _, _, m, _ in _MAIN} == set(_KINDS)
    for dt in SUPPORTED_DTYPES:
        assert {m for d_, _, m, _ in _MAIN if d_ == dt} == set(_KINDS)


@pytest.mark.parametrize("dtype,head_dim", _PAIRS, ids=lambda x: str(x).replace("torch.", ""))
def test_compiles_varlen_bottom_right_no_lse_other_out_dtype(dtype, head_dim):
    out = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16, FP8: FP8}[dtype]
    mask = "causal_bottom_right" if head_dim != 64 else "left_window"
    cfg = _config(dtype, head_dim, mask, False, varlen=True, lse=False, out_dtype=out)
    assert compile_kernel(cfg) is not None


def test_compiles_the_other_small_head_tile():
    for dtype in (torch.bfloat16, FP8):
        assert compile_kernel(_config(dtype, 32, "causal", True, tile=(128, 128))) is not None


def test_compiles_claimed_tiles():
    """Persistent CTAs that claim tiles in the one-CTA-per-tile order (the library's choice for
    large causal problems): the 16-bit path and fp8's staged V."""
    for dtype, head_dim in ((torch.bfloat16, 64), (FP8, 128)):
        cfg = library_config(dtype, head_dim, "causal", claim_tiles=True)
        assert cfg.schedule == Schedule.CLAIMED
        assert compile_kernel(cfg) is not None


def _ptx(cfg, tmp_path):
    compile_kernel(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    return next(tmp_path.glob("*.ptx")).read_text()


def test_a_forward_that_overflows_shared_memory_fails_to_compile_with_its_sizes():
    """A configuration whose buffers exceed the 227 KB a CTA may use is refused when it is built,
    with the sizes that overflow, rather than failing at launch (lab variants pin K/V stages)."""
    from lab.variants import variant_config

    base = library_config(torch.float8_e4m3fn, 256, "none", lse=False, seqlen_k=8192)
    with pytest.raises(ValueError, match=r"shared memory \(\d+ bytes with 128x128 tiles, 5 K/V stages, head dim 256\)"):
        compile_kernel(variant_config(base, tile_n=128, kv_stages=5))


def test_machine_code_has_wgmma_and_tma(tmp_path):
    ptx = _ptx(_config(torch.bfloat16, 128, "causal", True), tmp_path)
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx


_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta")


@pytest.mark.parametrize("dtype,head_dim,varlen", [(torch.bfloat16, 64, False), (torch.bfloat16, 128, False),
                                                   (FP8, 128, False), (torch.bfloat16, 64, True),
                                                   (torch.bfloat16, 128, True)])
def test_o_is_staged_with_stmatrix_and_tma_stored(dtype, head_dim, varlen, tmp_path):
    """16-bit output goes through shared memory and TMA (epilogue.store_o_tma): D=64 and fp8
    inputs in a buffer of its own, bf16 D=128 in the tile's Q buffer; varlen alike, through each
    sequence's own descriptor. The only global stores left are the LSE's."""
    cfg = _config(dtype, head_dim, "causal", False if varlen else True, varlen=varlen)
    assert cfg.o_store == (OStore.TMA_OWN_BUFFER if head_dim == 64 or dtype == FP8 else OStore.TMA_Q_BUFFER)
    # the attention kernel's own code (varlen modules also hold the descriptor-writing kernel)
    ptx = next(entry for entry in _ptx(cfg, tmp_path).split(".entry")[1:] if "wgmma" in entry)
    assert len(_TMA_STORE.findall(ptx)) == head_dim // 64  # one TMA box per 64 columns (128B swizzle)
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in ptx
    assert "cp.async.bulk.wait_group.read" in ptx
    assert len(re.findall(r"st\.global", ptx)) == 2  # the LSE of the thread's two rows


@pytest.mark.parametrize("dtype,head_dim,kw", [
    (FP8, 256, dict(varlen=True)),
    (torch.bfloat16, 128, dict(out_dtype=torch.float16)),
    (FP8, 128, dict(out_dtype=FP8)),
], ids=["fp8_varlen_d256", "mixed_out_d128", "fp8_out"])
def test_o_is_stored_directly_where_tma_cannot_write_it(dtype, head_dim, kw, tmp_path):
    """fp8 varlen at D=256 (its ring leaves no room for O's buffer, and the Q buffer holds fp8),
    an output type other than the input's where O would be staged in the Q buffer (D=128), and
    fp8 outputs keep the direct stores."""
    ptx = _ptx(_config(dtype, head_dim, "none", True, **kw), tmp_path)
    assert not _TMA_STORE.search(ptx) and "stmatrix" not in ptx
    assert "st.global" in ptx


def test_fp8_machine_code_uses_fp8_wgmma_for_both_products(tmp_path):
    ptx = _ptx(_config(FP8, 128, "none", True, out_dtype=FP8), tmp_path)
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx  # Q.K^T (N = tile_n)
    assert ".f32.e4m3.e4m3" in ptx and "m64n128k32" in ptx
    # P is rounded to fp8 with saturation before P.V (docs/semantics.md)
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("varlen", [False, True])
def test_fp8_v_staging_kernel_compiles(head_dim, varlen, tmp_path):
    from fmha.kernels.hopper.v_transpose import StageVKernel, compile_stage_v

    compile_stage_v(head_dim, varlen, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = "".join(p.read_text() for p in tmp_path.glob("*.ptx"))
    # the 128-key tile in 16-byte loads through shared memory; per head-dim word a thread reads
    # 16 words (four slot words x four keys), transposes them with byte permutes (8 per 4 x 4
    # bytes) and writes four 16-byte pieces of four rows; nothing else touches global memory
    assert len(re.findall(r"ld\.global(\.nc)?\.v4\.b32", ptx)) == head_dim // 16
    assert len(re.findall(r"ld\.global(\.nc)?\.b32", ptx)) == 2 * varlen  # cu_seqlens
    assert len(re.findall(r"st\.shared\.v4\.b32", ptx)) == head_dim // 16
    assert len(re.findall(r"ld\.shared\.b32", ptx)) == 16 and ptx.count("prmt.b32") == 32
    assert len(re.findall(r"st\.global\.v4\.b32", ptx)) == 4
    assert StageVKernel(head_dim, varlen).words == head_dim // 4


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 256), (torch.float16, 256), (torch.bfloat16, 128)],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_p_operand_is_packed_before_the_wgmma_fence(dtype, head_dim, tmp_path):
    """A register-A wgmma must find its operand registers written before ``wgmma.fence``. Packing
    16-bit halves into them between the fence and the MMA (what an element-wise conversion of P
    led to with 80-key tiles) makes ptxas serialize the P.V MMAs (advisory C7519)."""
    ptx = _ptx(_config(dtype, head_dim, "none", True), tmp_path)
    inside = re.findall(r"wgmma\.fence\.sync\.aligned;(.*?)wgmma\.commit_group", ptx, flags=re.S)
    assert inside and not any(re.search(r"mov\.b32\s+%r\d+, \{%rs", block) for block in inside)
    kind = "bf16x2" if dtype == torch.bfloat16 else "f16x2"
    assert f"cvt.rn.{kind}.f32" in ptx


_BWD_MASKS = ["none", "causal", "causal_bottom_right", "window", "left_window", "compressed_causal"]
_BWD = [(dt, d, _BWD_MASKS[(i + j) % len(_BWD_MASKS)]) for i, (dt, d) in
        enumerate(itertools.product((torch.float16, torch.bfloat16), (32, 64, 128, 256))) for j in range(2)]


@pytest.mark.parametrize("dtype,head_dim,mask", _BWD, ids=lambda x: str(x).replace("torch.", ""))
def test_backward_compiles_with_wgmma_tma_and_a_dq_reduce_add(dtype, head_dim, mask, tmp_path):
    """The backward kernel for every head dim it serves, both 16-bit dtypes and every mask kind:
    five warpgroup MMAs per query tile (S^T, dP^T, dV, dK, dQ), TMA loads, dS^T staged with
    stmatrix, dQ added by a bulk reduce-add of each warpgroup's fragment-ordered block (no
    per-element atomics)."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from kernel_configs import problem_for

    cfg = HopperBackwardConfig.from_problem(problem_for(dtype, head_dim, mask))
    compile_backward(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)
    if head_dim == 256:  # S^T and dP^T split by query columns, dK and dV by head dim
        assert cfg.split_head_dim and (cfg.tile_m, cfg.tile_n) == (64, 64)
        assert f"m64n{cfg.tile_m // 2}k16" in wgmma and f"m64n{head_dim // 2}k16" in wgmma
    else:
        assert f"m64n{cfg.tile_m}k16" in wgmma and f"m64n{head_dim}k16" in wgmma
    # dQ: each warpgroup's 64 query rows over the whole head dim (128-row tiles), else all rows
    # over half of it
    assert f"m64n{cfg.dq_cols_per_warpgroup}k16" in wgmma
    assert cfg.dq_cols_per_warpgroup == (head_dim if head_dim == 64 else head_dim // 2)
    assert "cp.async.bulk.tensor" in ptx and "stmatrix" in ptx
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert not re.search(r"(red|atom)\.global(\.\w+)*\.add\.f32", ptx)


@pytest.mark.parametrize("dtype,head_dim,mask", [(torch.bfloat16, 128, "causal_bottom_right"),
                                                  (torch.float16, 64, "window"), (torch.bfloat16, 32, "none")],
                         ids=lambda x: str(x).replace("torch.", ""))
def test_varlen_backward_moves_every_tile_through_sequence_descriptors(dtype, head_dim, mask, tmp_path):
    """Varlen: a descriptor-writing kernel narrows four descriptors per sequence (q, k, v, dO; six
    with D=128's TMA-stored dK and dV; the fragment-ordered dQ accumulator needs none), and every
    TMA load of the backward uses them."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from kernel_configs import problem_for

    cfg = HopperBackwardConfig.from_problem(problem_for(dtype, head_dim, mask, varlen=True))
    assert cfg.varlen
    compile_backward(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    describe, kernel = ptx.split(".entry")[1:3]
    assert cfg.sequence_descriptors == (6 if head_dim == 128 else 4)
    assert "describe_sequences" in describe
    assert describe.count("tensormap.replace.tile.global_address") == cfg.sequence_descriptors
    fenced = set(re.findall(r"fence\.proxy\.tensormap::generic\.acquire\.gpu \[(%rd\d+)\]", kernel))
    assert len(fenced) == cfg.sequence_descriptors
    loads = re.findall(r"cp\.async\.bulk\.tensor\.(\d)d\.shared::cta\.global[^;]*\[(%rd\d+), \{", kernel)
    tiles = {desc for _, desc in loads if desc in fenced}
    rows = [desc for _, desc in loads if desc not in fenced]
    assert len(tiles) == 4  # K, V, Q, dO through their sequence's descriptors
    # the LSE and delta through the packed tensors' own: rows past a ragged tile's sequence are
    # replaced in the kernel
    assert len(rows) == 2
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in kernel


def _assert_tiles_listed_before_the_kernel(dump_dir):
    """The compiled launch (PTX in ``dump_dir``): the descriptor pass, the one-CTA lister (counts
    per cost in shared memory, a scan of the counts), then the kernel."""
    ptx = next(dump_dir.glob("*.ptx")).read_text()
    entries = re.findall(r"\.entry (\w+?)_fmha", ptx)
    assert entries == ["kernel_cutlass_describe_sequences", "kernel_cutlass_list_work_tiles", "kernel_cutlass_kernel"]
    listing = ptx.split(".entry")[2]
    assert listing.count("atom.shared.add") == 2 and "shfl.sync.up" in listing


def test_varlen_with_unread_lengths_lists_its_tiles_on_the_gpu(tmp_path):
    """Lengths not read on the host (max lengths given): the launch runs a one-CTA kernel that
    counts the tiles per cost in shared memory, scans the counts and writes the cost-sorted list
    and its length, before the descriptor pass and the attention kernel."""
    import dataclasses

    from fmha.kernels.hopper.config import HopperForwardConfig
    from fmha.problem import KernelOptions
    from kernel_configs import problem_for

    problem = dataclasses.replace(problem_for(torch.bfloat16, 64, "causal", varlen=True), seqlens_q=None,
                                  seqlens_k=None)
    cfg = HopperForwardConfig.from_problem(problem, KernelOptions())
    assert cfg.tiles_on_device
    compile_kernel(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    _assert_tiles_listed_before_the_kernel(tmp_path)
    assert not HopperForwardConfig.from_problem(problem_for(torch.bfloat16, 64, "causal", varlen=True),
                                                KernelOptions()).tiles_on_device


@pytest.mark.parametrize("varlen,has_dlse,head_dim", [(False, True, 128), (True, False, 64), (False, False, 96),
                                                     (True, False, 192)])
def test_backward_row_pass_reads_rows_with_16_byte_loads(varlen, has_dlse, head_dim, tmp_path):
    """The row pass before the backward (delta, the LSE in log2 units, the dQ accumulator zeroed):
    a group of threads per row (a power of two), each reading 16-byte pieces of O and of dO (one
    at D=64/128, three at D=96/192) and zeroing its pieces of the row's span of the fp32
    accumulator's tile with 16-byte stores; the group's sums meet by shuffles."""
    from fmha.kernels.common.backward_rows import BackwardRowsConfig
    from fmha.kernels.hopper.backward_runner import compile_backward_rows

    cfg = BackwardRowsConfig(torch.bfloat16, head_dim, varlen, has_dlse, 64)
    pieces = head_dim // 8
    assert cfg.threads_per_row * cfg.pieces_per_thread == pieces
    assert cfg.threads_per_row == (pieces if head_dim in (64, 128) else 4 if head_dim == 96 else 8)
    compile_backward_rows(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert ptx.count("ld.global.v4") == 2 * cfg.pieces_per_thread  # O and dO
    assert ptx.count("st.global.v4") == 2 * cfg.pieces_per_thread  # 8 fp32 of the accumulator each
    assert ptx.count("shfl.sync.bfly") == cfg.threads_per_row.bit_length() - 1
    # the LSE (and dLSE) of the row; varlen: cu_seqlens three times (the search for the row's
    # sequence, its start and its end)
    assert ptx.count("ld.global.b32") == 1 + int(has_dlse) + (3 if varlen else 0)


def test_backward_row_pass_refuses_rows_it_cannot_split():
    from fmha.kernels.common.backward_rows import BackwardRowsConfig

    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        BackwardRowsConfig(torch.bfloat16, 36, False, False, 64)


def _backward_ptx(cfg, dump_dir) -> str:
    from fmha.kernels.hopper.backward_runner import compile_backward

    dump_dir.mkdir(exist_ok=True)
    compile_backward(cfg, extra_options=f"--keep-ptx --dump-dir={dump_dir}")
    return next(dump_dir.glob("*.ptx")).read_text()


@pytest.mark.parametrize("varlen", [False, True])
def test_deterministic_backward_orders_the_dq_adds(varlen, tmp_path):
    """deterministic=True: before its dQ reduce-add the dQ warp spins on an acquire load of the
    query tile's semaphore, and after it waits for the add to complete (not only its read of
    shared memory) before the release store that lets the next K/V tile add."""
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.problem import KernelOptions
    from kernel_configs import problem_for

    problem = problem_for(torch.bfloat16, 64, "causal", varlen=varlen)
    ptx = _backward_ptx(HopperBackwardConfig.from_problem(problem, KernelOptions(deterministic=True)),
                        tmp_path / "deterministic")
    order = re.findall(r"ld\.acquire\.gpu|cp\.reduce\.async\.bulk|cp\.async\.bulk\.wait_group\s|st\.release\.gpu",
                       ptx)
    assert order[0] == "ld.acquire.gpu" and order[-1] == "st.release.gpu"
    assert order[-2].startswith("cp.async.bulk.wait_group")  # without .read: the add has completed
    assert max(i for i, o in enumerate(order) if o.startswith("cp.reduce")) < len(order) - 2
    plain = _backward_ptx(HopperBackwardConfig.from_problem(problem), tmp_path / "plain")
    assert "ld.acquire.gpu" not in plain and "st.release.gpu" not in plain


def test_deterministic_selection_backward_orders_dq_and_the_split_lists_adds(tmp_path):
    """NSA selection with ``deterministic``: the dQ warp's acquire-spin and release store around
    its reduce-add, as the dense backward's; and a split list's fp32 dK/dV reductions between an
    acquire-spin on the list's counter and a gpu fence before the release store that passes the
    turn. Without it, none of these."""
    from fmha.kernels.hopper.bwd_config import selection_backward_config

    ptx = _backward_ptx(selection_backward_config(torch.bfloat16, 128, 128, 16, deterministic=True),
                        tmp_path / "deterministic")
    order = re.findall(r"ld\.acquire\.gpu|cp\.reduce\.async\.bulk|red\.\S*global\S*add\.f32|red\.\S*add\.f32"
                       r"|fence\.acq_rel\.gpu|st\.release\.gpu", ptx)
    reds = [i for i, o in enumerate(order) if o.startswith("red")]
    bulk = [i for i, o in enumerate(order) if o.startswith("cp.reduce")]
    acquires = [i for i, o in enumerate(order) if o == "ld.acquire.gpu"]
    releases = [i for i, o in enumerate(order) if o == "st.release.gpu"]
    assert reds and bulk and len(acquires) >= 2 and len(releases) >= 2
    assert any(a < bulk[0] for a in acquires) and any(r > bulk[-1] for r in releases)
    assert any(a < reds[0] for a in acquires)
    fence = [i for i, o in enumerate(order) if o == "fence.acq_rel.gpu" and i > reds[-1]]
    assert fence and any(r > fence[0] for r in releases)
    plain = _backward_ptx(selection_backward_config(torch.bfloat16, 128, 128, 16), tmp_path / "plain")
    assert "ld.acquire.gpu" not in plain and "st.release.gpu" not in plain


def test_backward_mask_families_cover_every_kind():
    assert {m for _, _, m in _BWD} == set(_BWD_MASKS)


@pytest.mark.parametrize("name", sorted(BACKWARD_VARIANTS))
def test_backward_variants_compile(name):
    """Each backward variant ``lab.bench --backward --variants`` times builds at the head dims it
    is timed at, causal and not (a variant that stopped compiling would only show as an error row
    of a GPU run)."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.masking import MaskKind

    overrides = dict(BACKWARD_VARIANTS[name])
    for d in overrides.pop("head_dims", (32, 64, 128)):
        for causal in (False, True):
            base = HopperBackwardConfig(torch.bfloat16, d, MaskKind.WINDOW if causal else MaskKind.NONE, False, causal,
                                        False)
            cfg = backward_variant_config(base, **overrides)
            assert cfg != base and all(getattr(cfg, k) == v for k, v in overrides.items())
            compile_backward(cfg)


def test_varlen_backward_runs_one_cta_per_listed_kv_tile(tmp_path):
    """Varlen backward: a CTA per listed (sequence, K/V tile), costliest first, instead of a grid
    over the longest sequence (most of whose CTAs had no keys); with the lengths unread, the launch
    lists the tiles on the GPU first. ``deterministic`` keeps the grid (its waits need the order)."""
    import dataclasses

    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.problem import KernelOptions
    from kernel_configs import problem_for

    read = problem_for(torch.bfloat16, 128, "causal", varlen=True)
    unread = dataclasses.replace(read, seqlens_q=None, seqlens_k=None)
    cfg = HopperBackwardConfig.from_problem(read, KernelOptions())
    assert cfg.tiles_listed and not cfg.tiles_on_device
    assert not HopperBackwardConfig.from_problem(read, KernelOptions(deterministic=True)).tiles_listed
    assert not HopperBackwardConfig.from_problem(problem_for(torch.bfloat16, 128, "causal"), KernelOptions()).tiles_listed
    cfg = HopperBackwardConfig.from_problem(unread, KernelOptions())
    assert cfg.tiles_listed and cfg.tiles_on_device
    compile_backward(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    _assert_tiles_listed_before_the_kernel(tmp_path)


def test_the_row_split_dq_needs_128_query_rows():
    from fmha.kernels.hopper.bwd import HopperAttentionBackward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.masking import MaskKind

    base = HopperBackwardConfig(torch.bfloat16, 128, MaskKind.NONE, False, False, False)
    assert base.tile_m == 64 and not base.dq_split_rows
    with pytest.raises(ValueError, match="tile_m = 128"):
        HopperAttentionBackward(backward_variant_config(base, dq_split_rows=True))


def test_the_gpu_check_can_run_a_backward_variant(monkeypatch):
    """``pytest -m gpu --bwd-variant NAME``: the library's choice of backward kernel becomes the
    variant at the head dims it applies to (and the config pickles, for the compile workers)."""
    import pickle

    import conftest
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from kernel_configs import problem_for

    monkeypatch.setattr(HopperBackwardConfig, "from_problem", HopperBackwardConfig.__dict__["from_problem"])
    assert HopperBackwardConfig.from_problem(problem_for(torch.bfloat16, 64, "causal")).tile_m == 128
    conftest.use_backward_variant("fmha_bwd_m64")
    at64 = HopperBackwardConfig.from_problem(problem_for(torch.bfloat16, 64, "causal"))
    assert at64.tile_m == 64 and not at64.dq_split_rows and pickle.loads(pickle.dumps(at64)) == at64
    assert type(HopperBackwardConfig.from_problem(problem_for(torch.bfloat16, 32, "causal"))) is HopperBackwardConfig


def test_the_gpu_check_can_run_a_forward_variant(monkeypatch):
    """``pytest -m gpu --fwd-variant NAME``: the library's choice of forward kernel becomes the
    variant where it is timed (fp8 at D=128 for ``fmha_fp8_n192``), and its configs pickle for
    the compile workers, also those of a variant that pins a derived property (a config
    subclass made by ``lab.variants``)."""
    import pickle

    import conftest
    from fmha.kernels.hopper.config import HopperForwardConfig
    from fmha.problem import KernelOptions
    from kernel_configs import problem_for

    library = HopperForwardConfig.__dict__["from_problem"]
    monkeypatch.setattr(HopperForwardConfig, "from_problem", library)
    conftest.use_forward_variant("fmha_fp8_n192")
    fp8 = HopperForwardConfig.from_problem(problem_for(torch.float8_e4m3fn, 128, "causal"), KernelOptions())
    assert fp8.tile_n == 192 and pickle.loads(pickle.dumps(fp8)) == fp8
    bf16 = HopperForwardConfig.from_problem(problem_for(torch.bfloat16, 128, "causal"), KernelOptions())
    assert type(bf16) is HopperForwardConfig and bf16.tile_n == 128
    monkeypatch.setattr(HopperForwardConfig, "from_problem", library)
    conftest.use_forward_variant("fmha_eager_rescale")
    eager = HopperForwardConfig.from_problem(problem_for(torch.bfloat16, 128, "causal"), KernelOptions())
    assert type(eager) is not HopperForwardConfig and not eager.lazy_rescale
    assert pickle.loads(pickle.dumps(eager)) == eager


def test_tma_stored_dkv_narrow_two_more_descriptors_for_packed_batches(tmp_path):
    """D=128 on a packed batch: dK and dV go out by TMA stores through descriptors
    narrowed to each sequence (six per sequence instead of four), so a ragged K/V tile's store
    stops at its sequence's end."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.masking import MaskKind

    cfg = HopperBackwardConfig(torch.bfloat16, 128, MaskKind.WINDOW, False, True, False, varlen=True,
                               tiles_listed=True)
    assert (backward_variant_config(cfg, dkv_store_tma=False).sequence_descriptors, cfg.sequence_descriptors) == (4, 6)
    compile_backward(cfg, extra_options=f"--keep-ptx --dump-dir={tmp_path}")
    ptx = next(tmp_path.glob("*.ptx")).read_text()
    assert ptx.count("tensormap.replace.tile.global_address") == 6
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.tile", ptx)) == 4  # dK, dV: 2 boxes each


@pytest.mark.parametrize("name", [None, "fmha_bwd_m80"])
def test_dq_conversion_compiles_for_the_fragment_ordered_accumulator(name):
    """The passes around the fragment-ordered dQ accumulator, the row pass that zeroes it and the
    conversion into dQ (``dq_convert.py``), build for every head dim, dtype and layout the library
    (and the 80-row tile at every length) uses, dense and packed."""
    from fmha.kernels.hopper.backward_runner import compile_dq_convert
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.kernels.hopper.dq_convert import DqConvertConfig
    from fmha.masking import MaskKind

    from fmha.kernels.common.backward_rows import BackwardRowsConfig
    from fmha.kernels.hopper.backward_runner import compile_backward_rows

    overrides = dict(BACKWARD_VARIANTS[name]) if name else {}
    for d in overrides.pop("head_dims", (32, 64, 128)):
        for dtype in (torch.bfloat16, torch.float16):
            for varlen in (False, True):
                cfg = HopperBackwardConfig(dtype, d, MaskKind.NONE, False, False, False, varlen=varlen)
                if overrides:
                    cfg = backward_variant_config(cfg, **overrides)
                compile_dq_convert(DqConvertConfig.of(cfg))
                # and the row pass that zeroes the accumulator in that order
                compile_backward_rows(BackwardRowsConfig(dtype, d, varlen, False, cfg.tile_m))


def _prmt(a, b, selector):
    """PTX ``prmt.b32`` (default mode): byte k of the result is byte ``selector`` nibble k of
    the 8 bytes b:a."""
    pool = (a & 0xFFFFFFFF) | (b & 0xFFFFFFFF) << 32
    return sum(((pool >> 8 * ((selector >> 4 * k) & 7)) & 0xFF) << 8 * k for k in range(4))


def test_the_4x4_byte_transpose_of_v_staging():
    """``transpose_4x4_bytes`` (the fp8 V staging kernel's byte permutes), on a model of
    ``prmt``: word j of the result holds byte j of each of the four input words, in order."""
    from fmha.kernels.hopper.v_transpose import transpose_4x4_bytes

    words = [sum((4 * i + b) << 8 * b for b in range(4)) for i in range(4)]  # byte b of word i: 4 i + b
    rows = transpose_4x4_bytes(_prmt, *words)
    assert list(rows) == [sum((4 * i + j) << 8 * i for i in range(4)) for j in range(4)]


@pytest.mark.parametrize("head_dim,seqlen", [(32, 300), (64, 200), (128, 77), (128, 256), (256, 33)])
def test_v_staging_kernel_addresses_match_the_torch_staging(head_dim, seqlen):
    """The staging kernel's index arithmetic, run in Python over every CTA and thread with a model
    of ``prmt`` (its shared-memory swizzle, the slot words' keys, the pieces' places, the blocks
    past S_pad left out, zeros past the sequence), gives the bytes of ``stage_v_fp8_torch``;
    every shared-memory word is written once and every staged word once."""
    import itertools

    from fmha.kernels.hopper.v_staging import stage_v_fp8_torch, staged_length
    from fmha.kernels.hopper.v_transpose import (_KEY_OFFSETS, _ROW_PIECES, _THREADS, _TILE_KEYS, StageVKernel,
                                                 transpose_4x4_bytes)

    torch.manual_seed(head_dim + seqlen)
    batch, heads = 2, 3
    v = torch.randint(0, 256, (batch, seqlen, heads, head_dim), dtype=torch.uint8)
    kernel, words, s_pad = StageVKernel(head_dim, False), head_dim // 4, staged_length(seqlen)
    src = v.view(torch.int32).tolist()  # [b][key][h][word]
    staged = [[[[None] * (s_pad // 4) for _ in range(head_dim)] for _ in range(heads)] for _ in range(batch)]
    num_blocks = s_pad // 32
    for b, h, tile in itertools.product(range(batch), range(heads), range(-(-s_pad // _TILE_KEYS))):
        raw = [[None] * words for _ in range(_TILE_KEYS)]
        key0, pieces = tile * _TILE_KEYS, words // 4
        for c in range(_TILE_KEYS * pieces):  # thread c % 128, load c // 128
            key, col = c // pieces, (c % pieces) * 4
            at = kernel.swizzled(key, col)
            assert all(raw[key][at + e] is None for e in range(4))
            for e in range(4):
                raw[key][at + e] = src[b][key0 + key][h][col + e] & 0xFFFFFFFF if key0 + key < seqlen else 0
        for tid in range(_THREADS):
            p = tid % _ROW_PIECES
            if tile * (_TILE_KEYS // 32) + p // 2 >= num_blocks:
                continue
            for w in range(tid // _ROW_PIECES, words, _THREADS // _ROW_PIECES):
                for q in range(4):
                    keys = [16 * p + 2 * q + off for off in _KEY_OFFSETS]
                    out = transpose_4x4_bytes(_prmt, *(raw[k][kernel.swizzled(k, w)] for k in keys))
                    for j in range(4):
                        slot = 4 * (tile * _ROW_PIECES + p) + q
                        assert staged[b][h][4 * w + j][slot] is None
                        staged[b][h][4 * w + j][slot] = out[j]
    got = torch.tensor(staged, dtype=torch.int64).to(torch.int32).view(torch.uint8)
    want = stage_v_fp8_torch(v.view(torch.float8_e4m3fn), None, seqlen).view(torch.uint8)
    assert torch.equal(got.reshape(want.shape), want)


@pytest.mark.parametrize("q_dtype,head_dim,page_size,packed,scale_tensors", [
    (torch.bfloat16, 128, 0, False, False), (torch.float16, 64, 16, False, True), (torch.bfloat16, 256, 0, False, False),
    (torch.bfloat16, 128, 32, True, True)])
def test_an_fp8_cache_is_staged_then_converted_for_16_bit_products(q_dtype, head_dim, page_size, packed,
                                                                   scale_tensors, tmp_path):
    """An fp8 cache under a 16-bit query (``kv_convert.py``): the cache is TMA-loaded as e4m3, the
    producer warpgroup's other warps convert it (cvt from e4m3 pairs) into the K/V ring, and both
    products stay 16-bit wgmmas; dense, paged and packed-query configurations compile, with the
    scales as launch scalars or read from (B, H_k) tensors."""
    from fmha.kernels.hopper.config import decode_config
    from fmha.masking import MaskKind

    cfg = decode_config(q_dtype, q_dtype, head_dim, MaskKind.WINDOW, False, True, True, True, 4, False, page_size,
                        4096, packed_q=packed, kv_dtype=FP8, kv_scale_tensors=scale_tensors)
    assert cfg.kv_converted and cfg.tile_m == 64 and cfg.kv_stages >= 2 and cfg.kv_staging_stages >= 2
    ptx = _ptx(cfg, tmp_path)
    kernel = next(entry for entry in ptx.split(".entry")[1:] if "wgmma" in entry)
    assert "cvt.rn.f16x2.e4m3x2" in kernel
    assert ".e4m3.e4m3" not in kernel  # no fp8 product: Q is never rounded to fp8
    name = "bf16" if q_dtype == torch.bfloat16 else "f16"
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.{name}\.{name}", kernel)


def test_one_key_pages_load_each_key_with_its_own_tma_box(tmp_path):
    """Pages of one key (SGLang's token-granular cache): the paged producer loads a K/V tile in
    runs of gcd(page, tile) = 1 key, one TMA box per key and 64-column atom (128 runs, more than
    the producer warp's 32 lanes hold in one block-table lookup)."""
    from fmha.kernels.hopper.config import decode_config
    from fmha.masking import MaskKind

    cfg = decode_config(torch.bfloat16, torch.bfloat16, 128, MaskKind.NONE, False, False, True, True, 4, False, 1,
                        4096)
    assert cfg.page_run == 1 and cfg.tile_n == 128
    kernel = next(entry for entry in _ptx(cfg, tmp_path).split(".entry")[1:] if "wgmma" in entry)
    # K and V tiles of 128 keys, two 64-column boxes a key each, in the loop and after it
    assert kernel.count("cp.async.bulk.tensor") >= 4 * cfg.tile_n
