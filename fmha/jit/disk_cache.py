"""On-disk cache of compiled kernels, so that a new process skips the compile.

A compiled kernel is exported as an object file (``export_to_c``) and loaded back with the
DSL's in-process linker (``cute.runtime.load_module``) as a TVM FFI function with the same
calling convention. The file name hashes the configuration, the DSL version and the source of
everything that generates device code, so an edit to a kernel never loads a stale binary.

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


def entry_name(cfg) -> str:
    import cutlass

    h = hashlib.sha256()
    for part in (repr(cfg), getattr(cutlass, "__version__", "?"), _source_digest()):
        h.update(part.encode())
    return "fmha_" + h.hexdigest()[:24]


def load_or_compile(cfg, compile_fn: Callable) -> Callable:
    """The compiled kernel for ``cfg``: from the disk cache if there, else ``compile_fn(cfg)``
    (then written to the cache, atomically, for the next process)."""
    if not enabled():
        return compile_fn(cfg)
    import cutlass.cute as cute

    name = entry_name(cfg)
    path = cache_dir() / f"{name}.o"
    if path.exists():
        try:
            return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=True), name)
        except Exception as e:  # a truncated or foreign file: rebuild it
            _log.warning("fmha: ignoring unreadable cached kernel %s (%s)", path, e)
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
