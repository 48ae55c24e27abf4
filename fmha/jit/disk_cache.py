"""On-disk cache of compiled kernels, so that a new process skips the compile.

A compiled kernel is exported as an object file (``export_to_c``) and, where a C compiler is
there (``$CC`` or ``cc``), linked into a shared library against the DSL's runtime library. A new
process loads the shared library with TVM FFI alone (``tvm_ffi.load_module``), without importing
the DSL's compiler, which is most of a warm start's time; without one, the object file is loaded
with the DSL's in-process linker (``cute.runtime.load_module``). Either way the kernel is a TVM
FFI function with the same calling convention. The file name hashes the configuration, the DSL
version and the source of everything that generates device code, so an edit to a kernel never
loads a stale binary.

``FMHA_CACHE_DIR`` chooses the directory (default ``~/.cache/fmha``); ``FMHA_DISK_CACHE=0``
turns the cache off. A file that fails to load is ignored and replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

_log = logging.getLogger("fmha")
_FMHA_ROOT = Path(__file__).resolve().parents[1]
_SOURCE_DIGEST = None


def enabled() -> bool:
    return os.environ.get("FMHA_DISK_CACHE", "1") not in ("0", "false", "off", "")


def cache_dir() -> Path:
    return Path(os.environ.get("FMHA_CACHE_DIR") or Path.home() / ".cache" / "fmha")


def _source_digest() -> str:
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha256()
        files = (sorted((_FMHA_ROOT / "kernels").rglob("*.py")) + sorted((_FMHA_ROOT / "jit").glob("*.py"))
                 + [_FMHA_ROOT / "masking.py", _FMHA_ROOT / "problem.py"])
        for f in files:
            h.update(str(f.relative_to(_FMHA_ROOT)).encode())
            h.update(f.read_bytes())
        _SOURCE_DIGEST = h.hexdigest()
    return _SOURCE_DIGEST


def _dsl_version() -> str:
    """The installed DSL's version, from its package metadata (importing it takes seconds)."""
    from importlib import metadata

    for dist in ("nvidia-cutlass-dsl", "nvidia_cutlass_dsl"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    import cutlass

    return getattr(cutlass, "__version__", "?")


def entry_name(cfg) -> str:
    h = hashlib.sha256()
    for part in (repr(cfg), _dsl_version(), _source_digest()):
        h.update(part.encode())
    return "fmha_" + h.hexdigest()[:24]


def _runtime_library_dirs() -> list:
    """Directories of the shared libraries an exported kernel links against: the DSL's runtime
    (``libcute_dsl_runtime.so``) and TVM FFI's."""
    import importlib.util

    import tvm_ffi

    dirs = [os.path.dirname(tvm_ffi.libinfo.find_libtvm_ffi())]
    spec = importlib.util.find_spec("nvidia_cutlass_dsl")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(p for p in Path(root).glob("*/lib/libcute_dsl_runtime.so"))
        if found:
            dirs.append(str(found[0].parent))
            return dirs
    raise FileNotFoundError("libcute_dsl_runtime.so not found beside nvidia_cutlass_dsl")


def c_compiler():
    """The C compiler that links the cache's shared libraries: ``$CC``, else ``cc`` or ``gcc``."""
    import shutil

    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _link_shared(obj: Path, lib: Path) -> None:
    """Link the exported object into a shared library TVM FFI can load without the DSL."""
    import subprocess

    cc = c_compiler()
    if not cc:
        raise FileNotFoundError("no C compiler (cc, gcc or $CC) to link the kernel cache's shared libraries")
    dirs = _runtime_library_dirs()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    cmd = [cc, "-shared", "-o", tmp, str(obj)]
    for d in dirs:
        cmd += [f"-L{d}", f"-Wl,-rpath,{d}"]
    cmd += ["-lcute_dsl_runtime", "-ltvm_ffi"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _load_shared(lib: Path, name: str) -> Callable:
    import tvm_ffi

    return tvm_ffi.load_module(str(lib))[name]


def load_or_compile(cfg, compile_fn: Callable) -> Callable:
    """The compiled kernel for ``cfg``: from the disk cache if there, else ``compile_fn(cfg)``
    (then written to the cache, atomically, for the next process)."""
    if not enabled():
        return compile_fn(cfg)
    name = entry_name(cfg)
    path = cache_dir() / f"{name}.o"
    lib = path.with_suffix(".so")
    if lib.exists():
        try:
            return _load_shared(lib, name)
        except Exception as e:  # moved runtime libraries, a truncated file: try the object file
            _log.info("fmha: cached kernel library %s did not load (%s)", lib, e)
    if path.exists():
        import cutlass.cute as cute

        try:
            kernel = getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
        except Exception as e:  # a truncated or foreign file: rebuild it
            _log.warning("fmha: ignoring unreadable cached kernel %s (%s)", path, e)
        else:
            _try_link(path, lib)  # the next process then loads it without the DSL again
            return kernel
    compiled = compile_fn(cfg)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".o", dir=path.parent)
        os.close(fd)
        compiled.export_to_c(tmp, name)
        os.replace(tmp, path)
    except Exception as e:  # a read-only home, a full disk: run uncached
        _log.warning("fmha: could not write the kernel cache in %s (%s)", path.parent, e)
        return compiled
    _try_link(path, lib)
    return compiled


def _try_link(path: Path, lib: Path) -> None:
    try:
        _link_shared(path, lib)
    except Exception as e:  # no compiler: the next process loads the object file with the DSL
        _log.info("fmha: no shared library for cached kernel %s (%s)", path, e)
