"""``python -m fmha`` end to end (subprocess) and its checker."""

import math
import subprocess
import sys

import pytest
import torch

from fmha.cli import check


def fmha_cli(*args):
    return subprocess.run([sys.executable, "-m", "fmha", *args], capture_output=True, text=True,
                          timeout=120)


def test_readme_command_verifies():
    r = fmha_cli("--q_shape", "2,300,4,64", "--k_shape", "2,300,2,64", "--is_causal")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "verified"
    assert any(line.startswith("backend: ") for line in lines)
    assert "TFLOP/s" in r.stdout and "mask=causal(top_left)" in r.stdout
    if not torch.cuda.is_available():
        assert "running the PyTorch reference on the CPU" in r.stdout
        assert "inputs are on the CPU" in r.stdout


def test_varlen_fp8_window_lse():
    r = fmha_cli("--q_shape", "3,0,4,64", "--k_shape", "3,0,2,64", "--varlen_q", "17,0,40",
                 "--varlen_k", "30,5,1", "--window_size", "8,-1", "--bottom_right_align",
                 "--in_dtype", "float8_e4m3fn", "--lse", "--scale_q", "0.5", "--inv_scale_o", "2")
    assert r.returncode == 0, r.stderr
    assert "varlen B=3" in r.stdout and "window(8,None,bottom_right)" in r.stdout
    assert "LSE max abs err" in r.stdout and r.stdout.splitlines()[-1] == "verified"


def test_variants_run_and_verify():
    """Softcap, sinks, fp64 inputs, and V's head dim apart from Q's (``--v_head_dim``): checked in
    fp64 (on the CPU the reference runs them)."""
    r = fmha_cli("--q_shape", "2,37,4,48", "--k_shape", "2,41,2,48", "--is_causal", "--softcap", "5", "--sinks",
                 "--lse", "--in_dtype", "bfloat16")
    assert r.returncode == 0 and "softcap=5 sinks" in r.stdout and r.stdout.strip().endswith("verified"), r.stdout
    r = fmha_cli("--q_shape", "1,20,2,16", "--in_dtype", "float64", "--window_size", "4,-2")
    assert r.returncode == 0 and r.stdout.strip().endswith("verified"), r.stdout + r.stderr
    r = fmha_cli("--q_shape", "1,70,2,192", "--k_shape", "1,90,1,192", "--v_head_dim", "128", "--is_causal")
    assert r.returncode == 0 and r.stdout.strip().endswith("verified"), r.stdout + r.stderr


def test_failed_check_exits_nonzero():
    r = fmha_cli("--q_shape", "1,64,2,32", "--tolerance", "0")
    assert r.returncode == 1 and "FAILED" in r.stdout


def test_bad_arguments_exit_2():
    r = fmha_cli("--q_shape", "1,64,2,0")
    assert r.returncode == 2 and "head dim must be at least 1" in r.stderr
    r = fmha_cli("--q_shape", "2,64,2,32", "--varlen_q", "1,2,3")
    assert r.returncode == 2 and "must equal the number of lengths" in r.stderr
    for page in ("-16", "0", "257"):  # a negative or zero page was a traceback or a silent dense cache
        r = fmha_cli("--q_shape", "1,1,2,64", "--k_shape", "1,64,2,64", "--kvcache", "--page_size", page)
        assert r.returncode == 2 and "from 1 to 256" in r.stderr, (page, r.stderr)
    r = fmha_cli("--q_shape", "1,1,2,64", "--page_size", "16")
    assert r.returncode == 2 and "--kvcache" in r.stderr
    # negative sizes were a traceback (rc 1), and a leading dash an argparse puzzle
    for flag, shape in (("--q_shape", "1,-5,2,32"), ("--q_shape", "-1,10,2,32"), ("--k_shape", "1,-3,2,32")):
        args = ("--q_shape", "1,10,2,32", flag, shape) if flag == "--k_shape" else (flag, shape)
        r = fmha_cli(*args)
        assert r.returncode == 2 and "sizes must be >= 0" in r.stderr, (shape, r.stderr)
    r = fmha_cli("--q_shape", "1,10,0,32")
    assert r.returncode == 2 and "k has no heads" in r.stderr


def test_window_with_an_unbounded_left_side_parses():
    """The help's own syntax: -1 for an unbounded side, first side included."""
    r = fmha_cli("--q_shape", "1,40,2,32", "--window_size", "-1,8")
    assert r.returncode == 0 and "window(None,8" in r.stdout and r.stdout.strip().endswith("verified"), r.stdout + r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the kernel may run on a GPU")
def test_kernel_backend_without_gpu_exits_2():
    r = fmha_cli("--q_shape", "1,64,2,32", "--backend", "kernel")
    assert r.returncode == 2 and "no fmha kernel supports this call" in r.stderr


def test_check_flags_nan_and_lse_pattern():
    ref_o = torch.ones(2, 3, dtype=torch.float64)
    ref_lse = torch.tensor([0.5, -math.inf], dtype=torch.float64)
    ok, _ = check(ref_o.half(), ref_lse.float(), ref_o, ref_lse, 1e-3)
    assert ok
    bad_o = ref_o.clone()
    bad_o[0, 0] = math.nan
    ok, summary = check(bad_o.half(), None, ref_o, None, 1e-3)
    assert not ok and "1 NaN/inf mismatches" in summary
    ok, summary = check(ref_o.half(), torch.tensor([0.5, 0.0]), ref_o, ref_lse, 1e-3)
    assert not ok and "1 NaN/inf mismatches" in summary
    ok, summary = check(ref_o.half(), torch.tensor([0.6, -math.inf]), ref_o, ref_lse, 1e-3)
    assert not ok and "LSE max abs err 1.000e-01" in summary


def test_kvcache_paged_and_dense_verify():
    for extra in (["--page_size", "32"], []):
        r = fmha_cli("--q_shape", "2,3,4,64", "--k_shape", "2,200,2,64", "--kvcache", "--is_causal",
                     "--in_dtype", "bfloat16", "--iterations", "1", *extra)
        assert r.returncode == 0 and "verified" in r.stdout, r.stdout + r.stderr
        assert ("paged (32 rows a page)" in r.stdout) == bool(extra)
        # what served it and how fast, as the plain path says; the LSE checked only with --lse
        assert "backend: reference" in r.stdout and "TFLOP/s" in r.stdout, r.stdout
        assert "LSE max abs err" not in r.stdout
    r = fmha_cli("--q_shape", "2,3,4,64", "--k_shape", "2,200,2,64", "--kvcache", "--lse", "--softcap", "5",
                 "--sinks", "--iterations", "1")
    assert r.returncode == 0 and "verified" in r.stdout and "LSE max abs err" in r.stdout, r.stdout + r.stderr
    assert fmha_cli("--q_shape", "2,3,4,64", "--page_size", "32").returncode == 2
    assert fmha_cli("--q_shape", "2,3,4,64", "--kvcache", "--page_size", "257").returncode == 2


def test_named_mods_run_and_verify():
    """--score_mod / --mask_mod / --block_mask end to end, and the functions they name: causal
    as a mask mod equals the built-in causal mask, document:N makes N documents, a bad name or a
    block mask without a mask mod exits 2."""
    import argparse

    import fmha
    from fmha.cli import named_mods

    r = fmha_cli("--q_shape", "2,100,4,64", "--score_mod", "alibi", "--mask_mod", "document:3", "--block_mask",
                 "--in_dtype", "bfloat16", "--lse")
    assert r.returncode == 0 and r.stdout.strip().endswith("verified"), r.stdout + r.stderr
    assert "score_mod" in r.stdout and "block_mask" in r.stdout, r.stdout
    r = fmha_cli("--q_shape", "3,0,4,32", "--varlen_q", "0,1,70", "--varlen_k", "5,1,90", "--score_mod",
                 "softcap:20", "--mask_mod", "window:30")
    assert r.returncode == 0 and r.stdout.strip().endswith("verified"), r.stdout + r.stderr
    for bad in (["--score_mod", "foo"], ["--mask_mod", "window"], ["--block_mask"], ["--mask_mod", "document:x"],
                ["--score_mod", "softcap:0"], ["--mask_mod", "window:-3"]):
        r = fmha_cli("--q_shape", "1,40,2,32", *bad)
        assert r.returncode == 2 and "--" in r.stderr, (bad, r.stderr)

    args = argparse.Namespace(score_mod=None, mask_mod="causal", seed=0)
    _, causal = named_mods(args, 2, 40, "cpu")
    q, k, v = (torch.randn(1, 40, 2, 32, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch.testing.assert_close(fmha.attention(q, k, v, mask_mod=causal), fmha.attention(q, k, v, causal=True))
    args.mask_mod = "document:5"
    _, doc = named_mods(args, 2, 200, "cpu")
    docs = next(t for t in doc.__closure__ if isinstance(t.cell_contents, torch.Tensor)).cell_contents
    assert docs.shape == (200,) and int(docs.max()) == 4 and bool((docs.diff() >= 0).all())
