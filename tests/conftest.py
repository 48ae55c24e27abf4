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
    group.addoption("--bwd-variant", default="", metavar="NAME",
                    help="run the backward cases with a backward variant of lab/variants.py (at the head "
                         "dims it applies to) instead of the library's kernel: its check before adoption")
    group.addoption("--fwd-variant", default="", metavar="NAME",
                    help="run the forward cases with a forward variant of lab/variants.py (where it is timed: "
                         "its dtype, head dims and masks) instead of the library's kernel")


def pytest_configure(config):
    name = config.getoption("--bwd-variant", default="")
    if name:
        use_backward_variant(name)
    name = config.getoption("--fwd-variant", default="")
    if name:
        use_forward_variant(name)


def use_forward_variant(name: str) -> None:
    """Make ``HopperForwardConfig.from_problem`` (the library's choice of forward kernel, also
    what the GPU check compiles beforehand) return variant ``name`` where it applies."""
    from fmha.kernels.hopper.config import HopperForwardConfig
    from lab.variants import forward_variant_applies, forward_variant_overrides, variant_config

    overrides, where = forward_variant_overrides(name)
    library = HopperForwardConfig.from_problem

    def from_problem(problem, options):
        cfg = library(problem, options)
        return variant_config(cfg, **overrides) if forward_variant_applies(cfg, where) else cfg

    HopperForwardConfig.from_problem = staticmethod(from_problem)


def use_backward_variant(name: str) -> None:
    """Make ``HopperBackwardConfig.from_problem`` (the library's choice of backward kernel, also
    what the GPU check compiles beforehand) return variant ``name`` where it applies."""
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from lab.variants import backward_variant_config, backward_variant_overrides

    overrides, head_dims = backward_variant_overrides(name)
    library = HopperBackwardConfig.from_problem

    def from_problem(problem, options=None):
        cfg = library(problem) if options is None else library(problem, options)
        if head_dims and cfg.head_dim not in head_dims:
            return cfg
        return backward_variant_config(cfg, **overrides)

    HopperBackwardConfig.from_problem = staticmethod(from_problem)


def pytest_sessionfinish(session, exitstatus):
    out = session.config.getoption("--gpu-report")
    module = sys.modules.get("test_gpu_kernels")
    if not out or module is None or not module.RESULTS:
        return
    import gpu_cases

    meta = dict(module.META, date=time.strftime("%Y-%m-%d %H:%M"),
                backward_variant=session.config.getoption("--bwd-variant") or None,
                forward_variant=session.config.getoption("--fwd-variant") or None,
                command="python -m pytest " + " ".join(session.config.invocation_params.args))
    n_ok = gpu_cases.write_reports(module.RESULTS, out, meta)
    print(f"\nGPU check: {n_ok}/{len(module.RESULTS)} cases pass; report in {out}")
