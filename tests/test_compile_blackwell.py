"""Compile the Blackwell kernel for sm_100a without a GPU (fake tensors, TVM FFI environment
stream), as the library would build it (``BlackwellForwardConfig.from_problem`` on a validated
problem): a change that breaks compilation fails here, in CI.

Coverage by default (about 15 compiles): every (input dtype, head dim) pair once, the mask kinds
rotated over the pairs so that each kind meets every dtype, persistent and not alternating, GQA;
varlen with each dtype (bottom-right and window masks, no LSE, another output dtype); fp8 in and
out; one sm_103a build. ``FMHA_BLACKWELL_FULL_MATRIX=1`` compiles the full product instead."""

import functools
import itertools
import os
import re
import tempfile

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.kernels.blackwell.backend import compile_forward  # noqa: E402
from fmha.kernels.blackwell.config import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, BlackwellForwardConfig  # noqa: E402
from fmha.problem import KernelOptions  # noqa: E402
from kernel_configs import MASKS, problem_for  # noqa: E402

FP8 = torch.float8_e4m3fn
KINDS = list(MASKS)  # none, causal, causal_bottom_right, window, left_window, compressed_causal


def blackwell_config(dtype=torch.bfloat16, head_dim=128, mask="none", persistent=None, varlen=False, lse=True,
                     out_dtype=None) -> BlackwellForwardConfig:
    """The configuration ``fmha`` builds for these choices (GQA: 4 query heads on 2 K/V heads)."""
    problem = problem_for(dtype, head_dim, mask, varlen, lse, out_dtype, heads_q=4, heads_k=2)
    return BlackwellForwardConfig.from_problem(problem, KernelOptions(persistent=persistent))


_PAIRS = list(itertools.product(SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS))
_MAIN = [(dt, d, KINDS[(i + 2 * (i // 3)) % len(KINDS)], i % 2 == 0) for i, (dt, d) in enumerate(_PAIRS)]
_VARLEN = [(torch.float16, 64, "causal_bottom_right", torch.bfloat16),
           (torch.bfloat16, 128, "window", torch.float16),
           (FP8, 32, "compressed_causal", FP8)]
if os.environ.get("FMHA_BLACKWELL_FULL_MATRIX") == "1":
    _MAIN = [(dt, d, m, p) for (dt, d), m, p in itertools.product(_PAIRS, KINDS, (False, True))]
    _VARLEN = [(dt, d, m, None) for (dt, d), m in itertools.product(_PAIRS, KINDS)]

_ids = lambda x: str(x).replace("torch.", "")  # noqa: E731
_DUMPS = tempfile.mkdtemp(prefix="fmha_blackwell_")


@functools.lru_cache(maxsize=None)
def compiled_cubin(cfg: BlackwellForwardConfig) -> str:
    """Compile ``cfg`` once per session, keeping its cubin (``test_sass_blackwell`` reads it)."""
    out = tempfile.mkdtemp(dir=_DUMPS)
    assert compile_forward(cfg, extra_options=f"--keep-cubin --dump-dir={out}") is not None
    return next(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".cubin"))


def test_every_mask_kind_meets_every_dtype():
    for dt in SUPPORTED_DTYPES:
        kinds = {m for d_, _, m, _ in _MAIN if d_ == dt} | {m for d_, _, m, _ in _VARLEN if d_ == dt}
        assert len(kinds) >= 3
    assert {m for _, _, m, _ in _MAIN} | {m for _, _, m, _ in _VARLEN} == set(KINDS)


@pytest.mark.parametrize("dtype,head_dim,mask,persistent", _MAIN, ids=_ids)
def test_compiles(dtype, head_dim, mask, persistent):
    cfg = blackwell_config(dtype, head_dim, mask, persistent)
    assert cfg.persistent == persistent
    assert os.path.exists(compiled_cubin(cfg))


@pytest.mark.parametrize("dtype,head_dim,mask,out_dtype", _VARLEN, ids=_ids)
def test_compiles_varlen_no_lse_other_out_dtype(dtype, head_dim, mask, out_dtype):
    cfg = blackwell_config(dtype, head_dim, mask, varlen=True, lse=False, out_dtype=out_dtype)
    assert cfg.varlen and not cfg.o_via_tma and not cfg.has_lse
    assert os.path.exists(compiled_cubin(cfg))


def test_compiles_fp8_output():
    cfg = blackwell_config(FP8, 128, "causal", out_dtype=FP8)
    assert cfg.out_dtype == FP8
    assert os.path.exists(compiled_cubin(cfg))


def test_compiles_for_sm_103a(tmp_path):
    import dataclasses

    cfg = dataclasses.replace(blackwell_config(torch.bfloat16, 128, "causal"), arch="sm_103a")
    compile_forward(cfg, extra_options=f"--keep-cubin --dump-dir={tmp_path}")
    assert [p.name for p in tmp_path.glob("*.cubin")] and all(".sm_103a." in p.name for p in tmp_path.glob("*.cubin"))


#: the variants: (dtype, head dim, mask, softcap, sinks, varlen)
_VARIANTS = [(torch.bfloat16, 128, "causal", True, False, False),
             (torch.bfloat16, 64, "window", False, True, False),
             (torch.float16, 128, "none", True, True, True),
             (FP8, 64, "causal_bottom_right", True, True, False)]


@pytest.mark.parametrize("dtype,head_dim,mask,softcap,sinks,varlen", _VARIANTS, ids=_ids)
def test_compiles_the_variants(dtype, head_dim, mask, softcap, sinks, varlen):
    """Softcap (one ``tanh.approx`` per score, before the mask, in the softmax warpgroups) and
    sinks (the correction warpgroup's finalize, ``row_lse_and_inverse``) compile for sm_100a: the
    softcapped kernels have the MUFU.TANH a plain one has not, and neither spills."""
    import dataclasses

    from lab.machine_code import find_nvdisasm, sass_of

    if find_nvdisasm() is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    problem = dataclasses.replace(problem_for(dtype, head_dim, mask, varlen, heads_q=4, heads_k=2),
                                  softcap=30.0 if softcap else 0.0, has_sinks=sinks)
    cfg = BlackwellForwardConfig.from_problem(problem, KernelOptions())
    assert (cfg.softcap, cfg.has_sinks) == (softcap, sinks)
    sass = sass_of(compiled_cubin(cfg))
    assert ("MUFU.TANH" in sass) == softcap
    assert not re.search(r"\b(LDL|STL)\b", sass)
    plain = sass_of(compiled_cubin(dataclasses.replace(cfg, softcap=False, has_sinks=False)))
    assert "MUFU.TANH" not in plain


_SLOPES = torch.linspace(-1.0, -0.1, 4)
_DOCS = torch.zeros(300, dtype=torch.int32)


def _alibi(score, b, h, q_idx, kv_idx, aux):
    return score + aux[0][h] * (kv_idx - q_idx)


def _same_document(b, h, q_idx, kv_idx):
    return _DOCS[q_idx] == _DOCS[kv_idx]  # a captured tensor: the kernel reads it


@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
def test_compiles_score_and_mask_mods(which):
    """The same callables the Hopper kernels take compile into the Blackwell softmax: a score
    mod reading an aux tensor on every score, a mask mod reading a captured tensor where the
    element-wise mask runs (every tile, without a block mask). The kernel reads the tensor
    (global loads the plain kernel has not); the mask mod does not spill, the score mod (on 128
    scores a thread, at the softmax's 184 registers) spills a little (docs/blackwell.md)."""
    import dataclasses

    from fmha.mods import call_mods
    from fmha.options import parse
    from lab.machine_code import find_nvdisasm, sass_of

    if find_nvdisasm() is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    opts = parse(score_mod=_alibi, causal=True) if which == "score_mod" else parse(mask_mod=_same_document)
    mods = call_mods(opts, (_SLOPES,) if which == "score_mod" else ())
    problem = problem_for(torch.bfloat16, 128, "causal" if which == "score_mod" else "none", False,
                          heads_q=4, heads_k=2)
    cfg = BlackwellForwardConfig.from_problem(dataclasses.replace(problem, mods=mods.signature()), KernelOptions())
    assert cfg.mods is not None
    sass = sass_of(compiled_cubin(cfg))
    plain = sass_of(compiled_cubin(dataclasses.replace(cfg, mods=None)))
    loads = lambda text: len(re.findall(r"\bLDG\b", text))  # noqa: E731
    assert loads(sass) > loads(plain)
    spills = len(re.findall(r"\b(LDL|STL)\b", sass))
    assert spills == 0 if which == "mask_mod" else spills <= 48, spills


def test_block_masks_are_refused_with_the_reason():
    import dataclasses

    from fmha.kernels.blackwell.config import why_unsupported
    from fmha.mods import ModsSignature

    problem = dataclasses.replace(problem_for(torch.bfloat16, 128, "none", False),
                                  mods=ModsSignature(None, None, (), True))
    assert any("block masks" in r for r in why_unsupported(problem, KernelOptions()))
