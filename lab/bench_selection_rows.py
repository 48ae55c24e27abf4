"""Experiment: the selection backward's query tile and list splitting
(``bwd_config.selection_backward_config``'s ``query_tile_rows`` and ``list_pieces``). Each K/V tile
walks the query tiles with a position that chose one of its blocks; with GQA groups of g, a 64-row
tile holds 64/g positions, most of which did not choose the block, and block 0's list holds
every query tile of the sequence (docs/nsa.md).

For each variant ``rows:pieces`` or ``default`` (the configuration fmha runs: split lists, and at
D=128 16-row tiles) the script patches the selection backward's configuration (a rows value
applies at D=128 only, where dQ^T takes tiles under 64 rows), runs every selection backward case of ``tests/test_gpu_nsa.py``
against the fp64 reference (``--check``), then times the backward alone (the kernel's runner,
forward outputs given) on one packed sequence, D=128, with ``lab/bench_nsa.py``'s lists; the
gradients are compared with the first variant's.

    python lab/bench_selection_rows.py --variants default,64:1,32:8 --check --out /tmp/rows.json
"""

import argparse
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import fmha.backends as backends  # noqa: E402
import fmha.kernels.hopper.selection_runner as selection_runner  # noqa: E402
from fmha.kernels.hopper.bwd_config import selection_backward_config  # noqa: E402
from lab.bench_nsa import BLOCK, selection_lists  # noqa: E402
from lab.timing import keep_row, seconds_per_call  # noqa: E402


def use_variant(variant: str) -> None:
    def config_of(problem):
        cfg = selection_backward_config(problem.dtype, problem.head_dim, problem.head_dim_v, problem.group)
        if variant == "default":
            return cfg
        rows, pieces = (int(x) for x in variant.split(":"))
        rows = rows if problem.head_dim == 128 else 0  # fewer than 64 rows: dQ^T, D=128 only
        return dataclasses.replace(cfg, query_tile_rows=rows, list_pieces=pieces)
    selection_runner.backward_config_of = config_of
    backends._runners.clear()


def check() -> list:
    import test_gpu_nsa as t

    failures = []
    for case in range(len(t.SELECTION_BACKWARD_CASES)):
        try:
            t.test_the_selection_backward_kernel_against_the_reference(case)
        except Exception as e:  # noqa: BLE001 (reported per case)
            failures.append(f"case {case}: {type(e).__name__}: {str(e)[:300]}")
    return failures


def time_backward(total, hq, hk, rep):
    from fmha.backends import SELECTION, SELECTION_BACKWARD, runner_for, unsupported_reasons
    from fmha.nsa.selection_visits import SelectionProblem
    from fmha.problem import KernelOptions

    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(total, hq, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, hk, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sel = selection_lists(total, hk, 16, gen)
    cu = torch.tensor([0, total], dtype=torch.int32, device="cuda")
    problem = SelectionProblem.of(q, k, v, BLOCK)
    fwd = runner_for(SELECTION, unsupported_reasons(problem, KernelOptions(), kind=SELECTION)[0], problem,
                     KernelOptions())
    out, lse = fwd(problem, q, k, v, sel, cu, 128 ** -0.5)
    bwd = runner_for(SELECTION_BACKWARD, unsupported_reasons(problem, KernelOptions(), kind=SELECTION_BACKWARD)[0],
                     problem, KernelOptions())
    dout = torch.randn_like(out)
    grads = tuple(torch.empty_like(x) for x in (q, k, v))
    ms = seconds_per_call(lambda: bwd(problem, dout, q, k, v, out, lse, None, sel, cu, 128 ** -0.5, grads=grads),
                          rep) * 1e3
    return ms, tuple(g.float() for g in grads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="default,64:1")
    ap.add_argument("--tokens", default="8192,65536")
    ap.add_argument("--shapes", default="64/4,32/8")
    ap.add_argument("--rep", type=int, default=20)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows_out, base = [], {}
    for variant in args.variants.split(","):
        use_variant(variant)
        if args.check:
            fails = check()
            keep_row(rows_out, dict(variant=variant, check="passed" if not fails else fails), args.out)
        for shape in args.shapes.split(","):
            hq, hk = (int(x) for x in shape.split("/"))
            for total in (int(t) for t in args.tokens.split(",")):
                row = dict(variant=variant, heads=shape, tokens=total)
                try:
                    ms, grads = time_backward(total, hq, hk, args.rep)
                    row["backward_ms"] = round(ms, 3)
                    key = (shape, total)
                    if key in base:  # the same inputs: the gradients agree with the first variant's
                        row["speedup"] = round(base[key][0] / ms, 3)
                        row["grad_rel_diff"] = [round(float((a - b).norm() / b.norm()), 5)
                                                for a, b in zip(grads, base[key][1])]
                    else:
                        base[key] = (ms, grads)
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                keep_row(rows_out, row, args.out)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
