"""Options of the GPU check (``test_gpu_kernels.py``) and its report."""

import sys
import time


def pytest_addoption(parser):
    group = parser.getgroup("fmha GPU check")
    group.addoption("--gpu-suite", default="full", choices=["full", "quick"],
                    help="which matrix of kernel cases the gpu tests run")
    group.addoption("--gpu-workers", type=int, default=0,
                    help="processes compiling the kernels before the gpu tests (default: CPUs - 1)")
    group.addoption("--gpu-report", default="", metavar="DIR",
                    help="write the gpu tests' results.json and results.md into DIR")


def pytest_sessionfinish(session, exitstatus):
    out = session.config.getoption("--gpu-report")
    module = sys.modules.get("test_gpu_kernels")
    if not out or module is None or not module.RESULTS:
        return
    import gpu_cases

    meta = dict(module.META, date=time.strftime("%Y-%m-%d %H:%M"),
                command="python -m pytest " + " ".join(session.config.invocation_params.args))
    n_ok = gpu_cases.write_reports(module.RESULTS, out, meta)
    print(f"\nGPU check: {n_ok}/{len(module.RESULTS)} cases pass; report in {out}")
