"""The Hopper kernel's machine code, without a GPU: what ptxas says about a configuration, and
whether a change to the code changed the machine code of the configurations the library builds.

    python -m lab.machine_code report                       # registers, spills, wgmma/TMA counts
    python -m lab.machine_code report --head-dim 128 --mask causal --dtype float8_e4m3fn
    python -m lab.machine_code digest OUT [--shard 0/2]     # SASS of every configuration of the grid
    python -m lab.machine_code digest OUT --decode          # ... of the decode configurations
    python -m lab.machine_code compare BEFORE AFTER          # identical / same up to registers / diff

``digest`` compiles the kernel the library builds (``HopperForwardConfig.from_problem``) for each
problem of a fixed grid (dtypes x head dims x masks x schedules x varlen x LSE x output dtype)
and writes its SASS, with the kernel parameters' constant-bank offsets masked, to
``OUT/<problem>.sass``. Run it before and after a change and ``compare`` the two folders: a
restructuring that claims to keep the machine code must come out "identical" or "same up to
register numbers" for every problem.

``report`` needs ``ptxas`` (CUDA 13) on PATH; both need ``nvdisasm`` (``pip install
"nvidia-cuda-nvdisasm>=13,<14"``, a test extra).
"""

from __future__ import annotations

import argparse
import collections
import glob
import itertools
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


def problems() -> list:
    """(name, validate() keywords, options keywords) of the digest grid: every input dtype and
    head dim, each with masks, schedules (grid-stride, static causal walk, claimed, one CTA per
    tile), lengths that flip the Q-buffer and O-store choices, varlen with empty and length-1
    sequences, other output dtypes, and no LSE."""
    import torch

    out = []
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}
    other = {torch.bfloat16: torch.float16, torch.float16: torch.bfloat16, torch.float8_e4m3fn: torch.float8_e4m3fn}
    for (dn, dt), d in itertools.product(dtypes.items(), (32, 64, 128, 256)):
        def dense(tag, shape, lse=True, options=None, **mask):
            b, s, hq, hk = shape
            out.append((f"{dn}_d{d}_{tag}", dict(shape=("dense", b, s, hq, hk), dtype=dt, head_dim=d,
                                                  return_lse=lse, **mask), options or {}))
        dense("none_s1k", (4, 1024, 16, 16), lse=False)
        dense("none_s8k_nolse", (2, 8192, 16, 16), lse=False)
        dense("causal_s8k_claim", (2, 8192, 16, 16), causal=True)
        dense("causal_s1k_gqa", (2, 1024, 16, 2), causal=True)
        dense("window_br", (2, 2048, 8, 8), window_size=(100, 30), mask_align="bottom_right")
        dense("causal_onecta", (2, 2048, 8, 8), lse=False, options=dict(persistent=False), causal=True)
        out.append((f"{dn}_d{d}_compressed_varlen", dict(shape=("varlen", (256, 64, 128, 512), (64, 16, 32, 128)),
                                                         dtype=dt, head_dim=d, return_lse=True,
                                                         compressed_causal=True), {}))
        out.append((f"{dn}_d{d}_leftwin_varlen_out", dict(shape=("varlen", (300, 0, 1, 700), (300, 0, 1, 700)),
                                                          dtype=dt, head_dim=d, return_lse=False,
                                                          out_dtype=other[dt], window_size=(64, None)), {}))
    return out


def problem_of(spec: dict, options: dict):
    """The validated problem and kernel options of one ``problems()`` entry (CPU tensors)."""
    import torch

    from fmha.problem import KernelOptions
    from fmha.validation import validate

    spec = dict(spec)
    shape, dt, d = spec.pop("shape"), spec.pop("dtype"), spec.pop("head_dim")
    if shape[0] == "varlen":
        lens_q, lens_k = shape[1], shape[2]
        cu = lambda lens: torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)  # noqa: E731
        q = torch.zeros(sum(lens_q), 8, d).to(dt)
        k = torch.zeros(sum(lens_k), 4, d).to(dt)
        problem = validate(q, k, k, varlen=True, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k), **spec)
    else:
        _, b, s, hq, hk = shape
        q = torch.zeros(b, s, hq, d).to(dt)
        k = torch.zeros(b, s, hk, d).to(dt)
        problem = validate(q, k, k, **spec)
    return problem, KernelOptions(**options)


def compile_with_files(cfg, directory: str):
    """Compile ``cfg`` (a forward or a backward configuration) keeping its PTX and cubin in
    ``directory``; returns (ptx path, cubin path)."""
    from fmha.kernels.hopper.backward_runner import compile_backward
    from fmha.kernels.hopper.forward_runner import compile_forward
    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig

    compile_fn = compile_backward if isinstance(cfg, HopperBackwardConfig) else compile_forward
    compile_fn(cfg, extra_options=f"--keep-ptx --keep-cubin --dump-dir={directory}")
    return glob.glob(os.path.join(directory, "*.ptx"))[0], glob.glob(os.path.join(directory, "*.cubin"))[0]


def sass_of(cubin: str) -> str:
    return subprocess.run([find_nvdisasm(), "-c", cubin], capture_output=True, text=True, check=True).stdout


def normalize(sass: str) -> str:
    """Instructions and labels only (no addresses, encodings or headers); the kernel
    parameters' constant-bank offsets masked, since they move with the parameter list."""
    lines = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            lines.append(re.sub(r"c\[0x0\]\[0x[0-9a-f]+\]", "c[0x0][P]", m.group(1)))
        elif re.match(r"\s*\.L_x_\d+:", line):
            lines.append(line.strip())
    return "\n".join(lines) + "\n"


def _masked(text: str) -> str:
    text = re.sub(r"\.L_x_\d+", "L", text)
    text = re.sub(r"\bU?R\d+\b", "R", text)
    return re.sub(r"\bU?P\d\b", "P", text)


def _opcodes(text: str) -> list:
    return [re.match(r"(@!?U?P\w+\s+)?(\S+)", line.strip()).group(2)
            for line in text.splitlines() if line.strip() and not line.startswith(".L_x")]


def verdict(before: str, after: str) -> str:
    if before == after:
        return "identical"
    if _masked(before) == _masked(after):
        return "same up to register numbers"
    a, b = collections.Counter(_opcodes(before)), collections.Counter(_opcodes(after))
    delta = {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if a[k] != b[k]}
    return f"different: {sum(a.values())} -> {sum(b.values())} instructions, {delta}"


def backward_configs():
    """(name, config) of the backward kernels the digest grid holds: every head dim the backward
    had before its head dims widened, both 16-bit dtypes, without a mask and causal, dense and
    varlen, deterministic or not."""
    import torch

    from fmha.kernels.hopper.bwd_config import HopperBackwardConfig
    from fmha.masking import MaskKind

    for d, dt, causal, varlen, det in itertools.product((32, 64, 128, 256), ("bfloat16", "float16"), (False, True),
                                                         (False, True), (False, True)):
        kind = MaskKind.WINDOW if causal else MaskKind.NONE
        listed = varlen and not det
        cfg = HopperBackwardConfig(getattr(torch, dt), d, kind, False, causal, False, varlen=varlen,
                                   deterministic=det, tiles_listed=listed)
        name = f"bwd_{dt}_d{d}_{'causal' if causal else 'none'}{'_varlen' if varlen else ''}{'_det' if det else ''}"
        yield name, cfg


def decode_configs():
    """(name, config) of the forward's decode configurations (``config.decode_config``): GQA
    rows packed or not, dense and paged caches, split-KV, mixed batches (packed queries), causal
    (bottom-right) and no mask, head dims 64/128/256, bf16 and fp16, and fp8 caches (converted,
    with scalar or tensor scales)."""
    import torch

    from fmha.kernels.hopper.config import decode_config
    from fmha.masking import MaskKind

    bf, fp8 = torch.bfloat16, torch.float8_e4m3fn
    grid = [  # name, dtype, head dim, causal, rows per query, split, page size, packed queries, kv dtype, tensor scales
        ("dense_gqa", bf, 128, False, 4, False, 0, False, None, False),
        ("dense_mha_split", bf, 128, True, 1, True, 0, False, None, False),
        ("paged16_gqa_split", bf, 128, True, 4, True, 16, False, None, False),
        ("paged64_d64", torch.float16, 64, True, 8, False, 64, False, None, False),
        ("paged80_d256", bf, 256, True, 8, False, 80, False, None, False),
        ("mixed_paged64", bf, 128, True, 4, False, 64, True, None, False),
        ("fp8cache_dense_gqa", bf, 128, False, 4, False, 0, False, fp8, False),
        ("fp8cache_paged16_split", bf, 128, True, 4, True, 16, False, fp8, False),
        ("fp8cache_mixed_scales", bf, 128, True, 4, False, 64, True, fp8, True),
        ("fp8cache_fp16_d64_scales", torch.float16, 64, True, 1, True, 0, False, fp8, True),
    ]
    for name, dt, d, causal, rows, split, page, packed, kv, scales in grid:
        kind = MaskKind.WINDOW if causal else MaskKind.NONE
        yield f"decode_{name}", decode_config(dt, dt, d, kind, False, causal, causal, True, rows, split, page, 8192,
                                              packed_q=packed, kv_dtype=kv, kv_scale_tensors=scales)


def digest(out_dir: str, shard: str = "0/1", backward: bool = False, decode: bool = False) -> None:
    from fmha.kernels.hopper.config import HopperForwardConfig

    index, count = (int(x) for x in shard.split("/"))
    os.makedirs(out_dir, exist_ok=True)
    grid = backward_configs() if backward else decode_configs() if decode else (
        (name, HopperForwardConfig.from_problem(*problem_of(spec, options))) for name, spec, options in problems())
    for i, (name, cfg) in enumerate(grid):
        if i % count != index:
            continue
        with tempfile.TemporaryDirectory() as d:
            _, cubin = compile_with_files(cfg, d)
            text = normalize(sass_of(cubin))
        with open(os.path.join(out_dir, f"{name}.sass"), "w") as f:
            f.write(text)
        with open(os.path.join(out_dir, f"{name}.cfg"), "w") as f:
            f.write(repr(cfg) + "\n")
        print(f"{name}: {len(text.splitlines())} lines", flush=True)


def compare(before_dir: str, after_dir: str) -> int:
    counts = collections.Counter()
    for path in sorted(glob.glob(os.path.join(after_dir, "*.sass"))):
        name = os.path.basename(path)
        other = os.path.join(before_dir, name)
        if not os.path.exists(other):
            print(f"{name[:-5]:36s} (not in {before_dir})")
            continue
        v = verdict(open(other).read(), open(path).read())
        counts[v.split(":")[0]] += 1
        print(f"{name[:-5]:36s} {v}")
    print(dict(counts))
    return 0 if set(counts) <= {"identical", "same up to register numbers"} else 1


def report(cfg) -> dict:
    """ptxas's registers, spill bytes and advisories, and SASS instruction counts of ``cfg``."""
    with tempfile.TemporaryDirectory() as d:
        ptx, _ = compile_with_files(cfg, d)
        text = re.sub(r"^\.version \d+\.\d+", ".version 9.0", open(ptx).read(), count=1, flags=re.M)
        open(ptx, "w").write(text)  # the local ptxas may not know the DSL's newer ISA version
        cubin = os.path.join(d, "k.cubin")
        res = subprocess.run(["ptxas", "-arch=sm_90a", "-v", ptx, "-o", cubin], capture_output=True, text=True)
        log = res.stdout + res.stderr
        out = {
            "registers": int(m.group(1)) if (m := re.search(r"Used (\d+) registers", log)) else None,
            "spill_bytes": sum(int(x) for x in re.findall(r"(\d+) bytes spill", log)),
            "advisories": sorted(set(re.findall(r"\((C7\d\d\d)\)", log))),
        }
        if find_nvdisasm() and os.path.exists(cubin):
            sass = sass_of(cubin)
            for ins in ("HGMMA", "QGMMA", "UTMALDG", "UTMASTG", "LDL", "STL"):
                out[ins] = len(re.findall(rf"\b{ins}\b", sass))
        return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="ptxas's resource report of the library's kernels")
    rep.add_argument("--head-dim", type=int, nargs="*", default=[64, 128])
    rep.add_argument("--mask", nargs="*", default=["none", "causal"])
    rep.add_argument("--dtype", nargs="*", default=["bfloat16"], help="bfloat16 float16 float8_e4m3fn")
    rep.add_argument("--seqlen", type=int, default=2048,
                     help="keys (= queries) of the problem whose kernel is built: some choices depend on it")
    dig = sub.add_parser("digest", help="normalized SASS of the digest grid's kernels")
    dig.add_argument("out")
    dig.add_argument("--shard", default="0/1", help="i/n: only every n-th problem, from the i-th")
    dig.add_argument("--backward", action="store_true", help="the backward kernels' grid instead of the forward's")
    dig.add_argument("--decode", action="store_true", help="the forward's decode configurations instead")
    cmp_ = sub.add_parser("compare", help="compare two digests")
    cmp_.add_argument("before")
    cmp_.add_argument("after")
    args = ap.parse_args(argv)
    if args.command == "digest":
        return digest(args.out, args.shard, args.backward, args.decode)
    if args.command == "compare":
        return compare(args.before, args.after)

    import torch

    from fmha.kernels.hopper.config import HopperForwardConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    masks = {"none": {}, "causal": dict(causal=True), "window": dict(window_size=(256, 0)),
             "compressed": dict(compressed_causal=True)}
    for dt, d, m in itertools.product(args.dtype, args.head_dim, args.mask):
        # the kernel the library would build for a (1, seqlen, 16, d) call
        q = torch.zeros(1, args.seqlen, 16, d).to(getattr(torch, dt))
        cfg = HopperForwardConfig.from_problem(validate(q, q, q, **masks[m]), KernelOptions())
        print(f"{dt} D={d} tile={cfg.tile_m}x{cfg.tile_n} stages={cfg.kv_stages}+{cfg.q_stages}q {m:10s} "
              f"{cfg.schedule.value} {cfg.o_store.value}: {report(cfg)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
