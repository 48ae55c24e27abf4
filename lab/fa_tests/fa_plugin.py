"""pytest plugin: run FlashAttention-4's own tests (tests/cute, extracted by get_tests.sh into
.fa-tests/) against ``fmha.flash_attn``.

Load it with ``-p lab.fa_tests.fa_plugin``. After the test modules are imported, the entry points
they imported (``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``) are
replaced in each module by fmha's; everything else, the tests' reference (``attention_ref`` from
``flash_attn.cute.testing``) and helpers included, stays FlashAttention's. A call that fmha
refuses (``NotImplementedError``: a feature it does not have) makes the test skip with reason
"fmha refuses: ...", so refusals count apart from failures.

Options:
  --fa-sample N      keep a random sample of N collected cases, stratified per test function
                     (each function gets an equal share, or all its cases if it has fewer),
                     run in a seeded random order; the rest are deselected
  --fa-seed S        the sample's seed (default 0); the same seed picks the same cases
  --fa-report DIR    write DIR/fa_report.json and DIR/fa_report.md: counts per test function
                     (collected, sampled, passed, failed, errors, skipped by reason, xfailed)
  --fa-deadline SEC  cases not started SEC seconds into the session are skipped as "not run"
                     (the session then ends, and writes its report, within a time limit)
  --fa-stub-collect  with --collect-only on a machine without a GPU or without
                     flash-attn-4: stand-ins for torch.cuda's capability query (an SM90 GPU) and
                     for modules that do not import, so that collection and sampling can be
                     checked there

Test functions that exercise FlashAttention itself rather than its API (its private functions,
its compile cache, its own limits) are deselected as not applicable, with the reason in the
report (``NOT_APPLICABLE``).
"""

from __future__ import annotations

import functools
import importlib
import json
import math
import os
import random
import sys
import time
import types
from collections import Counter, defaultdict
from pathlib import Path

import pytest

#: the names swapped for fmha's in the test modules
ENTRY_POINTS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")

#: test functions that test FlashAttention's internals or limits, not its API: deselected
NOT_APPLICABLE = {
    "test_flash_attn_sm120_rejects_splitkv": "checks FlashAttention's SM120 split-KV refusal",
    "test_flash_attn_cache_separates_broadcast_layouts": "checks FlashAttention's compile cache "
                                                         "(its private _flash_attn_fwd)",
    "test_flash_attn_value_dim_larger_than_query_dim": "calls FlashAttention's private _flash_attn_fwd",
    "test_flash_attn_paged_non_tma_partial_loader_tile": "calls FlashAttention's private _flash_attn_fwd "
                                                         "with a tile size",
    "test_flash_attn_bwd_preallocated_outputs": "calls FlashAttention's private _flash_attn_fwd/_flash_attn_bwd",
    "test_flash_attn_fp8_paged_decode_tile_boundary": "calls FlashAttention's private _flash_attn_fwd "
                                                      "with fp8 descale tensors",
    "test_flash_attn_fp8_paged_decode_preserves_tail_mass": "calls FlashAttention's private _flash_attn_fwd "
                                                            "with fp8 descale tensors",
    "test_flash_attn_invalid_head_dim": "checks FlashAttention's head-dim limits (fmha serves those head "
                                        "dims on its reference)",
    "test_flash_attn_varlen_seqlen_k_per_split": "checks that FlashAttention's split extent reaches its "
                                                 "kernel (a scheduling hint fmha ignores)",
}

REFUSED = "fmha refuses: "
DEADLINE = "fmha harness: not run, the --fa-deadline had passed"


def pytest_addoption(parser):
    group = parser.getgroup("fmha: FlashAttention's tests against fmha.flash_attn")
    group.addoption("--fa-sample", type=int, default=0, metavar="N",
                    help="keep a random sample of N collected cases, stratified per test function")
    group.addoption("--fa-seed", type=int, default=0, metavar="S", help="seed of the sample (default 0)")
    group.addoption("--fa-report", default="", metavar="DIR",
                    help="write fa_report.json and fa_report.md (counts per test function) into DIR")
    group.addoption("--fa-deadline", type=float, default=0, metavar="SECONDS",
                    help="skip the cases not started SECONDS after the session began (each xdist worker "
                         "counts from its own start), so that the session ends and writes its report")
    group.addoption("--fa-stub-collect", action="store_true",
                    help="collection only: stand in for the GPU and for modules that do not import")


# ---------------------------------------------------------------------------------------------
# stand-ins for collecting without a GPU


class _StandIn:
    """Any attribute of a module that could not be imported: calling it with a function returns
    the function (decorators and decorator factories keep working), anything else returns a
    stand-in. Collection never runs a test, so nothing else is needed."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]):
            return args[0]
        return _StandIn(self._name + "()")

    def __getattr__(self, attr):
        if attr.startswith("__"):  # protocols (inspect, copy, pickle) see a plain object
            raise AttributeError(attr)
        return _StandIn(f"{self._name}.{attr}")

    def __repr__(self):
        return f"<collection stand-in {self._name}>"


def _stand_in_module(name):
    module = types.ModuleType(name)
    module.__path__ = []  # a package: its submodules resolve to stand-ins too

    def attribute(attr):
        if attr.startswith("__"):  # inspect walks sys.modules reading __file__ and the like
            raise AttributeError(attr)
        return _StandIn(f"{name}.{attr}")

    module.__getattr__ = attribute
    return module


def _install_collection_stand_ins(config):
    import torch

    if not config.option.collectonly:
        raise pytest.UsageError("--fa-stub-collect only collects: add --collect-only")
    # the tests read the GPU's capability when imported: an SM90 (H100/H200) like the GPU machine's
    torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
    stubbed = []
    for name in ("einops", "flash_attn", "flash_attn.cute", "flash_attn.cute.interface", "flash_attn.cute.testing",
                 "flash_attn.cute.cache_utils"):
        try:
            importlib.import_module(name)
        except Exception:  # not installed, or needs what this machine lacks (triton, a GPU)
            for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[loaded]
            sys.modules[name] = _stand_in_module(name)
            stubbed.append(name)
    return stubbed


# ---------------------------------------------------------------------------------------------
# sampling


def _function_id(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def _function_name(nodeid: str) -> str:
    return _function_id(nodeid).rsplit("::", 1)[-1]


def pytest_configure(config):
    stubbed = _install_collection_stand_ins(config) if config.getoption("--fa-stub-collect") else []
    config.pluginmanager.register(FlashAttentionHarness(config, stubbed), "fmha_fa_harness")


def _quotas(sizes: dict, total: int) -> dict:
    """An equal share of ``total`` for each group, a group with fewer items giving its leftover
    to the others (deterministic: groups in sorted order)."""
    quota = {g: 0 for g in sizes}
    left = total
    open_groups = sorted(g for g in sizes if sizes[g])
    while left > 0 and open_groups:
        share = max(1, left // len(open_groups))
        for g in list(open_groups):
            if left == 0:
                break
            take = min(share, sizes[g] - quota[g], left)
            quota[g] += take
            left -= take
            if quota[g] == sizes[g]:
                open_groups.remove(g)
    return quota


def _argument(mark, position: int, name: str):
    return mark.args[position] if len(mark.args) > position else mark.kwargs.get(name)


def _grid_size(mark):
    """How many values a parametrize mark has, or None when that is not known beforehand."""
    values = _argument(mark, 1, "argvalues")
    return len(values) if isinstance(values, (list, tuple)) else None


def _first_argname(mark) -> str:
    names = _argument(mark, 0, "argnames")
    return (names.split(",")[0] if isinstance(names, str) else names[0]).strip()


def _digits(n: int, sizes) -> tuple:
    """Case ``n`` of a grid as one value index per mark (the first mark most significant)."""
    digits = []
    for size in reversed(sizes):
        n, d = divmod(n, size)
        digits.append(d)
    return tuple(reversed(digits))


def _expand_only_drawn(metafunc, marks, drawn) -> None:
    """Make each of ``marks``, as pytest applies it to ``metafunc``, keep only the partial cases
    that start a drawn one: pytest still builds every id, value and mark of the cases kept."""
    prefixes = [{case[:i + 1] for case in drawn} for i in range(len(marks))]
    firsts = [_first_argname(m) for m in marks]
    parametrize = metafunc.parametrize
    applied = []

    def parametrize_drawn(*args, **kwargs):
        parametrize(*args, **kwargs)
        i = len(applied)
        if i < len(marks) and kwargs.get("_param_mark") is marks[i]:
            applied.append(marks[i])
            keep = prefixes[i]
            metafunc._calls = [c for c in metafunc._calls
                               if tuple(c.indices[name] for name in firsts[:i + 1]) in keep]

    metafunc.parametrize = parametrize_drawn


def _skip_refusals(fn):
    """``fn`` with fmha's refusals (NotImplementedError) turned into a skip that says so."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as refusal:
            pytest.skip(REFUSED + str(refusal))

    call._fmha_swapped = True
    return call


def _patch_entry_points(items) -> list:
    """Swap the entry points the test modules imported for fmha's; returns what was swapped."""
    import fmha.flash_attn as ours

    modules = {id(m): m for m in (getattr(it, "module", None) for it in items) if m is not None}
    patched = []
    for module in modules.values():
        for name in ENTRY_POINTS:
            current = getattr(module, name, None)
            if current is not None and getattr(current, "_fmha_swapped", False) is not True:
                setattr(module, name, _skip_refusals(getattr(ours, name)))
                patched.append(f"{module.__name__}.{name}")
    return sorted(patched)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text[len("Skipped: "):] if text.startswith("Skipped: ") else text


def _failure_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.splitlines()[0][:300]
    text = str(report.longrepr).strip()
    return text.splitlines()[-1][:300] if text else ""


OUTCOMES = ("passed", "failed", "error", "skipped_refused", "skipped_by_test", "xfailed", "xpassed", "not_run")


class FlashAttentionHarness:
    """The plugin's state for one session: what was collected and sampled, and each case's outcome."""

    def __init__(self, config, stubbed):
        self.config = config
        self.stubbed = stubbed
        self.collected = {}  # function id -> parametrizations collected
        self.selection = None  # what the sample kept (on an xdist controller: from a worker)
        self.outcomes = {}  # nodeid -> {"outcome", "duration", "reason" or "message"}
        self.started = time.monotonic()

    def pytest_runtest_setup(self, item):
        deadline = self.config.getoption("--fa-deadline")
        if deadline and time.monotonic() - self.started > deadline:
            pytest.skip(DEADLINE)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_generate_tests(self, metafunc):
        """Count a function's parametrizations and keep a random N of them (N = --fa-sample), so
        that no function's share of the sample exceeds N. Expanding FlashAttention's grids in
        full (400,000 cases) takes half a minute per process; instead the N cases are drawn from
        the grid's shape beforehand and each parametrize mark, still applied by pytest, expands
        only the prefixes of drawn cases (``_expand_only_drawn``)."""
        fid = metafunc.definition.nodeid
        limit = self.config.getoption("--fa-sample")
        if _function_name(fid) in NOT_APPLICABLE:
            limit = 1  # one item stands for it; it is deselected with the others
        marks = list(metafunc.definition.iter_markers(name="parametrize"))
        sizes = [_grid_size(m) for m in marks]
        total = math.prod(sizes) if None not in sizes else None
        if limit and total is not None and total > limit:
            seed = self.config.getoption("--fa-seed")
            drawn = random.Random(f"{seed}:{fid}").sample(range(total), limit)
            _expand_only_drawn(metafunc, marks, [_digits(n, sizes) for n in drawn])
        yield
        metafunc.__dict__.pop("parametrize", None)
        calls = metafunc._calls  # pytest's list of the function's parametrizations
        self.collected[fid] = max(1, total if total is not None else len(calls))
        if limit and len(calls) > limit:  # grids whose size was not known beforehand
            seed = self.config.getoption("--fa-seed")
            keep = sorted(random.Random(f"{seed}:{fid}:calls").sample(range(len(calls)), limit))
            calls[:] = [calls[i] for i in keep]

    def pytest_collection_modifyitems(self, session, config, items):
        applicable = [it for it in items if _function_name(it.nodeid) not in NOT_APPLICABLE]
        not_applicable = sorted({_function_id(it.nodeid) for it in items} - {_function_id(it.nodeid)
                                                                              for it in applicable})
        groups = defaultdict(list)
        for it in applicable:
            groups[_function_id(it.nodeid)].append(it.nodeid)
        total = config.getoption("--fa-sample")
        if total:
            seed = config.getoption("--fa-seed")
            quota = _quotas({g: len(v) for g, v in groups.items()}, total)
            chosen = set()
            for g, nodeids in groups.items():
                chosen.update(random.Random(f"{seed}:{g}:sample").sample(sorted(nodeids), quota[g]))
        else:
            chosen = {it.nodeid for it in applicable}
        dropped = [it for it in items if it.nodeid not in chosen]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it.nodeid in chosen]
        if total:
            # a seeded order (the same in every xdist worker): cases a --fa-deadline leaves unrun are
            # then spread over the test functions instead of being the last functions' cases
            random.Random(f"{config.getoption('--fa-seed')}:order").shuffle(items)
        self.selection = {
            "collected": dict(self.collected),
            "sampled": dict(Counter(_function_id(it.nodeid) for it in items)),
            "not_applicable": not_applicable,
            "patched": _patch_entry_points(items),
            "stubbed": list(self.stubbed),
        }
        if hasattr(config, "workeroutput"):  # an xdist worker: the controller writes the report
            config.workeroutput["fa_selection"] = json.dumps(self.selection)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        """xdist controller: the selection comes from the workers (they all make the same one)."""
        selection = getattr(node, "workeroutput", {}).get("fa_selection")
        if selection and self.selection is None:
            self.selection = json.loads(selection)

    def pytest_runtest_logreport(self, report):
        record = self.outcomes.setdefault(report.nodeid, {"outcome": None, "duration": 0.0})
        record["duration"] += report.duration
        if hasattr(report, "wasxfail"):
            record["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.failed:
            if record["outcome"] not in ("failed", "error"):  # the first failure of the case counts
                record["outcome"] = "failed" if report.when == "call" else "error"
                record["message"] = _failure_line(report)
        elif report.skipped:
            reason = _skip_reason(report)
            record["outcome"] = ("not_run" if reason == DEADLINE else
                                 "skipped_refused" if reason.startswith(REFUSED) else "skipped_by_test")
            record["reason"] = reason
        elif report.when == "call" and record["outcome"] is None:
            record["outcome"] = "passed"

    def summary(self) -> dict:
        selection = self.selection or {"collected": {}, "sampled": {}, "not_applicable": [], "patched": [],
                                       "stubbed": list(self.stubbed)}

        def row(fid):
            return {"collected": selection["collected"].get(fid, 0), "sampled": selection["sampled"].get(fid, 0),
                    **{o: 0 for o in OUTCOMES}, "seconds": 0.0}

        per_function = {fid: row(fid) for fid in sorted(set(selection["collected"]) | set(selection["sampled"]))
                        if fid not in selection["not_applicable"]}
        reasons = Counter()
        failures = []
        for nodeid, record in sorted(self.outcomes.items()):
            r = per_function.setdefault(_function_id(nodeid), row(_function_id(nodeid)))
            if record["outcome"] is not None:
                r[record["outcome"]] += 1
            r["seconds"] = round(r["seconds"] + record["duration"], 2)
            if record["outcome"] in ("skipped_refused", "skipped_by_test"):
                reasons[record["reason"].split(";")[0][:200] or "(no reason given)"] += 1
            if record["outcome"] in ("failed", "error"):
                failures.append({"nodeid": nodeid, "outcome": record["outcome"], "message": record.get("message")})
        source = Path(os.environ.get("FA_TESTS_DIR", ".fa-tests")) / "SOURCE"
        return {
            "flash_attn_4_installed": _installed_version("flash-attn-4"),
            "tests_source": source.read_text().strip() if source.exists() else None,
            "seed": self.config.getoption("--fa-seed"),
            "sample": self.config.getoption("--fa-sample"),
            "collected": sum(selection["collected"].values()),
            "sampled": sum(selection["sampled"].values()),
            "not_applicable": {f: NOT_APPLICABLE[_function_name(f)] for f in selection["not_applicable"]},
            "patched": selection["patched"],
            "stubbed_for_collection": selection["stubbed"],
            "totals": {o: sum(r[o] for r in per_function.values()) for o in OUTCOMES},
            "skip_reasons": dict(reasons.most_common()),
            "per_function": per_function,
            "failures": failures,
        }

    def pytest_sessionfinish(self, session, exitstatus):
        directory = self.config.getoption("--fa-report")
        if not directory or hasattr(self.config, "workerinput"):  # xdist workers leave it to the controller
            return
        summary = self.summary()
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fa_report.json").write_text(json.dumps(summary, indent=2) + "\n")
        (out / "fa_report.md").write_text(markdown(summary))

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if hasattr(config, "workerinput") or self.selection is None:
            return
        s = self.selection
        terminalreporter.write_line(
            f"fmha.flash_attn: {sum(s['collected'].values())} FlashAttention cases collected, "
            f"{sum(s['sampled'].values())} sampled; swapped: {', '.join(s['patched']) or 'nothing'}"
            + (f"; stand-ins: {', '.join(s['stubbed'])}" if s["stubbed"] else ""))


def _installed_version(dist: str):
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def markdown(summary: dict) -> str:
    """The report's counts as a markdown page."""
    totals = ", ".join(f"{o} {n}" for o, n in summary["totals"].items())
    lines = ["# FlashAttention-4's tests against fmha.flash_attn", "",
             f"Tests: {summary['tests_source']}; flash-attn-4 installed: {summary['flash_attn_4_installed']}; "
             f"sample: {summary['sample'] or 'all'}, seed {summary['seed']}.", "",
             f"Collected {summary['collected']}, sampled {summary['sampled']}: {totals}.", "",
             "| test function | collected | sampled | passed | failed | error | skipped: fmha refuses "
             "| skipped by the test | xfailed | xpassed | not run (deadline) | seconds |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for fid, r in summary["per_function"].items():
        lines.append(f"| {fid.rsplit('::', 1)[-1]} | {r['collected']} | {r['sampled']} | {r['passed']} | "
                     f"{r['failed']} | {r['error']} | {r['skipped_refused']} | {r['skipped_by_test']} | "
                     f"{r['xfailed']} | {r['xpassed']} | {r['not_run']} | {r['seconds']:.0f} |")
    if summary["not_applicable"]:
        lines += ["", "Not applicable (deselected):", ""]
        lines += [f"- {f.rsplit('::', 1)[-1]}: {why}" for f, why in summary["not_applicable"].items()]
    if summary["skip_reasons"]:
        lines += ["", "Skip reasons:", ""]
        lines += [f"- {n} x {why}" for why, n in summary["skip_reasons"].items()]
    if summary["failures"]:
        lines += ["", "Failures:", ""]
        lines += [f"- {f['outcome']} `{f['nodeid']}`: {f['message']}" for f in summary["failures"]]
    return "\n".join(lines) + "\n"
