"""Compile kernel configurations for sm_90a (no GPU needed) and report what the machine code
says: registers, spills, wgmma (HGMMA) and TMA instruction counts, and ptxas performance
advisories such as C7512 "wgmma serialized".

    python scripts/kernel_report.py                  # a default set of configurations
    python scripts/kernel_report.py --head-dim 128 --mask causal

Needs ``ptxas`` (CUDA toolkit 13) on PATH and, for the SASS counts, ``nvdisasm`` (pip install
"nvidia-cuda-nvdisasm>=13,<14"). The DSL's PTX may declare a newer ISA version than the local
ptxas knows; the report then rewrites the version line, which is enough for these counts.
"""

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def find_nvdisasm():
    """Path of ``nvdisasm``: on PATH, or from the ``nvidia-cuda-nvdisasm`` wheel; None if neither."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            cand = os.path.join(base, "cu13", "bin", "nvdisasm")
            if os.path.exists(cand):
                return cand
    except ImportError:
        pass
    return None


def report(cfg) -> dict:
    from fmha.kernels.hopper.backend import compile_kernel

    with tempfile.TemporaryDirectory() as d:
        compile_kernel(cfg, extra_options=f"--keep-ptx --dump-dir={d}")
        ptx = glob.glob(os.path.join(d, "*.ptx"))[0]
        text = open(ptx).read()
        text = re.sub(r"^\.version \d+\.\d+", ".version 9.0", text, count=1, flags=re.M)
        open(ptx, "w").write(text)
        cubin = os.path.join(d, "k.cubin")
        res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True)
        log = res.stdout + res.stderr
        out = {
            "registers": int(m.group(1)) if (m := re.search(r"Used (\d+) registers", log)) else None,
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill", log)),
            "advisories": sorted(set(re.findall(r"\((C7\d\d\d)\)", log))),
        }
        nvd = find_nvdisasm()
        if nvd and os.path.exists(cubin):
            sass = subprocess.run([nvd, "-c", cubin], capture_output=True, text=True).stdout
            for ins in ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "LDL", "STL"):
                out[ins] = len(re.findall(rf"\b{ins}\b", sass))
        return out


def main(argv=None):
    import dataclasses

    import torch

    from fmha.kernels.hopper.backend import HopperConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--mask", nargs="*", default=["none", "causal"])
    ap.add_argument("--dtype", nargs="*", default=["bfloat16"], help="bfloat16 float16 float8_e4m3fn")
    ap.add_argument("--seqlen", type=int, default=2048,
                    help="keys (= queries) of the problem whose kernel is built: some choices depend on it")
    ap.add_argument("--variants", action="store_true", help="also the serial / no-ping-pong mainloops")
    args = ap.parse_args(argv)
    masks = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(256, 0)),
             "compressed": dict(compressed_causal=True)}
    variants = [(True, True)] + ([(True, False), (False, False)] if args.variants else [])
    for dt in args.dtype:
        for d in args.head_dim:
            # the kernel the library would build for a (1, seqlen, 16, d) call, persistent grid
            q = torch.zeros(1, args.seqlen, 16, d).to(getattr(torch, dt))
            for m in args.mask:
                problem = validate(q, q, q, **masks[m])
                default = HopperConfig.from_problem(problem, KernelOptions(persistent=True))
                for overlap, pingpong in variants:
                    cfg = dataclasses.replace(default, overlap=overlap, pingpong=pingpong)
                    print(f"{dt} D={d} tile={cfg.tile_m}x{cfg.tile_n} stages={cfg.kv_stages}+{cfg.q_stages}q "
                          f"{m:10s} overlap={int(overlap)} pingpong={int(pingpong)} "
                          f"serial<={cfg.serial_max_tiles} l2={int(cfg.l2_sections)}: {report(cfg)}", flush=True)


if __name__ == "__main__":
    main()
