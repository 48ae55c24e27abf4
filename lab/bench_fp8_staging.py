"""An experiment on the fp8 cache's staging ring (``kernels/hopper/kv_convert.py``): the library
stages e4m3 K/V tiles swizzled, so every converting thread recomputes the swizzle of each row it
reads; staged unswizzled (``LinearStaging``), a row's address is a constant offset from its
unit's, and the shared-memory reads stay free of bank conflicts (a warp reads whole rows).

    python -m lab.bench_fp8_staging --sass          # any machine: instructions of each kernel
    python -m lab.bench_fp8_staging --out DIR       # GPU: both kernels' decode times, side by side

The GPU run checks both against the fp32 reference on the cache's dequantized values before
timing them (CUDA graphs, ``triton.testing.do_bench_cudagraph``), and writes ``staging.json`` and
``staging.md``. Not yet run on a GPU (written 2026-12-04 without device time left).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fmha.kernels.hopper.fwd import HopperAttentionForward  # noqa: E402

#: (batch, query heads, K/V heads, keys) of the timed points, D = 128, one query row
POINTS = [(16, 32, 8, 8192), (64, 32, 8, 4096), (1, 32, 8, 131072), (32, 32, 32, 8192), (4, 32, 4, 32768)]


class LinearStaging(HopperAttentionForward):
    """The forward kernel with the converted cache staged row after row, unswizzled."""

    def staging_layout(self, width: int, kv_dtype, stage_elems: int):
        import cutlass.cute as cute

        cfg = self.cfg
        outer = cute.make_layout((cfg.tile_n, width, cfg.kv_staging_stages), stride=(width, 1, stage_elems))
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, outer)


KERNELS = {"swizzled (library)": HopperAttentionForward, "linear": LinearStaging}


def decode_config(batch, heads_q, heads_k, keys):
    import torch

    from fmha.kernels.hopper.config import decode_config as library_decode_config
    from fmha.masking import MaskKind

    bf = torch.bfloat16
    return library_decode_config(bf, bf, 128, MaskKind.NONE, False, False, False, False, heads_q // heads_k,
                                 False, 0, keys, kv_dtype=torch.float8_e4m3fn)


def sass_counts() -> dict:
    """Instruction counts of both kernels at the first point (compiled here, no GPU)."""
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from lab.machine_code import _opcodes, normalize, sass_of
    from fmha.kernels.hopper.forward_runner import compile_forward

    cfg = decode_config(*POINTS[0])
    counts = {}
    for name, cls in KERNELS.items():
        with tempfile.TemporaryDirectory() as d:
            compile_forward(cfg, extra_options=f"--keep-cubin --dump-dir={d}", kernel_class=cls)
            cubin = next(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".cubin"))
            ops = collections.Counter(_opcodes(normalize(sass_of(cubin))))
        counts[name] = dict(total=sum(ops.values()), **{k: ops[k] for k in ("LDS.64", "STS.128", "LOP3.LUT",
                                                                              "IMAD", "SHF.R.U32.HI", "LDL", "STL")})
    return counts


def run_gpu(out_dir: str) -> str:
    import torch
    from triton.testing import do_bench_cudagraph

    from fmha.jit.launch import sm_count
    from fmha.kernels.hopper import decode_runner
    from fmha.kernels.hopper.forward_runner import compile_forward
    from fmha.kvcache import decode_problem

    rows = []
    for batch, hq, hk, keys in POINTS:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(batch, 1, hq, 128, generator=g, device="cuda").to(torch.bfloat16)
        k, v = (torch.randn(batch, keys, hk, 128, generator=g, device="cuda") for _ in range(2))
        scale_k, scale_v = k.abs().max().item() / 448, v.abs().max().item() / 448
        k8, v8 = (k / scale_k).to(torch.float8_e4m3fn), (v / scale_v).to(torch.float8_e4m3fn)
        lengths = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        problem, _ = decode_problem(q, k8, v8, lengths, scale_k=scale_k, scale_v=scale_v)
        kq, vq = k8.float() * scale_k, v8.float() * scale_v
        want = torch.nn.functional.scaled_dot_product_attention(
            q.float().transpose(1, 2), kq.repeat_interleave(hq // hk, 2).transpose(1, 2),
            vq.repeat_interleave(hq // hk, 2).transpose(1, 2)).transpose(1, 2)
        for name, cls in KERNELS.items():
            runner = decode_runner.HopperDecodeRunner(problem)
            plan = runner.plan(problem, sm_count(q.device))
            compiled = compile_forward(plan.cfg, kernel_class=cls)
            runner.load = lambda cfg, fn, compiled=compiled, plain=runner.load: compiled if cfg == plan.cfg else plain(cfg, fn)
            out = torch.full_like(q, float("nan"))

            def call(runner=runner, out=out):
                runner(problem, q, k8, v8, lengths, None, out, None)

            call()
            torch.cuda.synchronize()
            err = ((out.float() - want).norm() / want.norm()).item()
            row = dict(point=f"B{batch} H{hq}/{hk} Sk{keys}", kernel=name, rel_l2=err)
            if err < 2e-2:
                row["graph_us"] = 1e3 * do_bench_cudagraph(call, rep=100, return_mode="median")
                row["fp8_tb_s"] = 2 * batch * keys * hk * 128 / (row["graph_us"] * 1e-6) / 1e12
            else:
                row["error"] = f"wrong answer (rel L2 {err:.3g})"
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "staging.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    by = {(r["point"], r["kernel"]): r for r in rows}
    names = list(KERNELS)
    lines = ["| point | " + " | ".join(f"{n} us" for n in names) + " | linear / library speed |",
             "|---" * (len(names) + 2) + "|"]
    ratios = []
    for point in dict.fromkeys(r["point"] for r in rows):
        cells = [f"{by[(point, n)]['graph_us']:.0f}" if "graph_us" in by[(point, n)] else "-" for n in names]
        a, b = by[(point, names[0])], by[(point, names[1])]
        ratio = a["graph_us"] / b["graph_us"] if "graph_us" in a and "graph_us" in b else None
        if ratio:
            ratios.append(ratio)
        lines.append(f"| {point} | " + " | ".join(cells) + f" | {f'{ratio:.2f}x' if ratio else '-'} |")
    if ratios:
        lines += ["", f"Median: {statistics.median(ratios):.2f}x"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "staging.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sass", action="store_true", help="instruction counts of both kernels (no GPU)")
    ap.add_argument("--out", default=os.path.join("results", "bench", "fp8_staging"))
    args = ap.parse_args(argv)
    if args.sass:
        print(json.dumps(sass_counts(), indent=1))
    else:
        print(run_gpu(args.out))


if __name__ == "__main__":
    main()
