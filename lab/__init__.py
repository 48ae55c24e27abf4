"""Measurement tools for fmha's kernels (benchmark, variants, machine code, profiling,
sanitizer cases): run from the repository root, e.g. ``python -m lab.bench``. Not part of the
installed library."""
