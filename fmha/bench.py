"""``python -m fmha.bench``: the side-by-side benchmark. It is a measurement tool, not part of
the library, and lives in the repository's ``lab/bench.py``; this entry point runs it from a
checkout (the repository root on ``sys.path``, as ``python -m`` puts the working directory)."""

import sys


def main(argv=None):
    try:
        from lab.bench import main as bench_main
    except ImportError as e:
        sys.exit(f"python -m fmha.bench runs from a checkout of the fmha repository, in its root "
                 f"(the benchmark is lab/bench.py): {e}")
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
