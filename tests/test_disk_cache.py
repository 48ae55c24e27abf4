"""The on-disk kernel cache: a second 'process' loads the exported kernel instead of compiling."""

import pytest
import torch

pytest.importorskip("cutlass")

from fmha.jit import disk_cache  # noqa: E402
from fmha.kernels.hopper.forward_runner import compile_forward as compile_kernel  # noqa: E402
from fmha.kernels.hopper.config import Schedule  # noqa: E402
from kernel_configs import library_config  # noqa: E402

CFG = library_config(torch.bfloat16, 64, "none", lse=False)


def test_second_load_comes_from_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    compiles = []

    def counting_compile(cfg):
        compiles.append(cfg)
        return compile_kernel(cfg)

    first = disk_cache.load_or_compile(CFG, counting_compile)
    files = list(tmp_path.glob("*.o"))
    assert len(compiles) == 1 and len(files) == 1 and files[0].stat().st_size > 0
    second = disk_cache.load_or_compile(CFG, counting_compile)
    assert len(compiles) == 1  # loaded, not compiled
    assert callable(first) and callable(second)


def test_key_changes_with_the_configuration_and_a_broken_file_is_rebuilt(tmp_path, monkeypatch):
    import dataclasses

    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    other = dataclasses.replace(CFG, schedule=Schedule.ONE_CTA_PER_TILE)
    assert disk_cache.entry_name(CFG) != disk_cache.entry_name(other)
    (tmp_path / f"{disk_cache.entry_name(CFG)}.o").write_bytes(b"not an object file")
    compiles = []
    disk_cache.load_or_compile(CFG, lambda cfg: compiles.append(cfg) or compile_kernel(cfg))
    assert len(compiles) == 1
    assert (tmp_path / f"{disk_cache.entry_name(CFG)}.o").stat().st_size > 1000


def test_disabled_cache_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FMHA_DISK_CACHE", "0")
    disk_cache.load_or_compile(CFG, compile_kernel)
    assert not list(tmp_path.iterdir())


_FRESH_PROCESS = r"""
import sys
from fmha.jit import disk_cache
from kernel_configs import library_config
import torch

def refuse(cfg):
    raise AssertionError("compiled instead of loaded")

kernel = disk_cache.load_or_compile(library_config(torch.bfloat16, 64, "none", lse=False), refuse)
print(callable(kernel), "cutlass" in sys.modules)
"""


@pytest.mark.skipif(not disk_cache.c_compiler(), reason="no C compiler to link the shared library")
def test_a_fresh_process_loads_the_shared_library_without_the_dsl(tmp_path, monkeypatch):
    import os
    import subprocess
    import sys

    monkeypatch.setenv("FMHA_CACHE_DIR", str(tmp_path))
    disk_cache.load_or_compile(CFG, compile_kernel)
    assert len(list(tmp_path.glob("*.so"))) == 1
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__)] + sys.path))
    res = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.stdout.split() == ["True", "False"], res.stderr[-2000:]  # loaded, and the DSL never imported
    (tmp_path / f"{disk_cache.entry_name(CFG)}.so").write_bytes(b"not a library")
    res = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.stdout.split()[0] == "True", res.stderr[-2000:]  # the object file, through the DSL
