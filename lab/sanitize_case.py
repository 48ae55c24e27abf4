"""Small cases through the kernel (dense causal at D 64/128, persistent CTAs claiming causal
tiles, varlen, fp8, D 32/256), for compute-sanitizer (``--claim-only``: the claiming case alone;
``--mixed-only``: mixed batches over a paged cache, valid and with bad block tables, lengths and
offsets, whose clamps must keep every access in bounds; with ``--fp8`` the cache is fp8, staged and
converted in shared memory):

    compute-sanitizer --tool racecheck python -m lab.sanitize_case
    compute-sanitizer --tool memcheck  python -m lab.sanitize_case
    compute-sanitizer --tool racecheck python -m lab.sanitize_case --claim-only
    compute-sanitizer --tool memcheck  python -m lab.sanitize_case --mixed-only
    compute-sanitizer --tool memcheck  python -m lab.sanitize_case --mixed-only --fp8

Exits 1 if the output disagrees with the reference (the sanitizer reports its own findings).

Run it once without the sanitizer first, so that the kernels load from the disk cache: a kernel
compiled under memcheck adds the DSL's own driver probing to the report (``cuGetProcAddress``
returning CUDA_ERROR_INVALID_VALUE while it detects the GPU), which is not a finding."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import fmha
from fmha.masking import MaskSpec
from fmha.reference import attention_reference


def claimed_tiles_case(dev) -> bool:
    """Persistent CTAs that claim their tiles (``KernelOptions.claim_tiles``): 8 CTAs over 36
    causal tiles, so each claims several and cycles through its Q buffers and the hand-off."""
    from fmha.jit.launch import persistent_grid_of
    from fmha.kernels.hopper.forward_runner import HopperRunner, compile_forward
    from fmha.kernels.hopper.config import HopperForwardConfig
    from fmha.problem import KernelOptions
    from fmha.validation import validate

    q = torch.randn(1, 1100, 4, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 1100, 2, 128, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 1100, 2, 128, device=dev, dtype=torch.bfloat16)
    problem = validate(q, k, v, causal=True)
    cfg = HopperForwardConfig.from_problem(problem, KernelOptions(claim_tiles=True))
    assert cfg.claims_tiles
    o = torch.full_like(q, float("nan"))
    with persistent_grid_of(8, torch.cuda.current_device()):
        HopperRunner(cfg, compile_forward(cfg))(problem, q, k, v, o, None)
    ref, _ = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True))
    err = ((o.float() - ref).norm() / ref.norm()).item()
    print(f"dense causal D=128, 8 CTAs claiming 36 tiles: rel L2 {err:.2e}")
    return err < 1e-2


def mixed_batch_cases(dev, fp8: bool = False) -> bool:
    """Packed query rows (decodes, a chunk, an empty sequence) over a paged cache of 16-key pages:
    the valid call against the reference, then calls with a block-table entry that is no page, a
    length past the block table, offsets out of order and past the rows: each raises the device
    flag, and none may read or write out of bounds (what memcheck checks)."""
    rows, keys, page, hq, hk, d = [1, 40, 0, 3], [17, 100, 5, 64], 16, 8, 2, 64
    pages = [-(-n // page) for n in keys]
    cu = torch.tensor([0] + torch.tensor(rows).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    q = torch.randn(sum(rows), hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(sum(pages), page, hk, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.full((len(rows), max(pages)), -1, dtype=torch.int32, device=dev)
    order = torch.randperm(sum(pages), device=dev).to(torch.int32)
    at = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[at:at + n]
        at += n
    lens = torch.tensor(keys, dtype=torch.int32, device=dev)
    scales = {}
    if fp8:  # an e4m3 cache with its dequantization factors
        scales = dict(scale_k=0.05, scale_v=0.02)
        k, v = (k.float() / 0.05).to(torch.float8_e4m3fn), (v.float() / 0.02).to(torch.float8_e4m3fn)
    call = lambda cu_q, used, tab: fmha.attention_varlen(q, k, v, cu_q, seqused_k=used, block_table=tab,  # noqa: E731
                                                          causal=True, backend="kernel", max_seqlen_q=max(rows),
                                                          **scales)
    o = call(cu, lens, table)
    ref = fmha.attention_varlen(q, k, v, cu, seqused_k=lens, block_table=table, causal=True, backend="reference",
                                **scales)
    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
    print(f"mixed batch over 16-key pages{' (fp8 cache)' if fp8 else ''}: rel L2 {err:.2e}")
    ok = err < 1e-2
    bad_table, too_long, backwards, past_end = table.clone(), lens.clone(), cu.clone(), cu.clone()
    bad_table[1, 2] = 10_000
    too_long[3] = max(pages) * page + 50
    backwards[2] = 0
    past_end[4] = sum(rows) + 100
    for name, args in (("a block-table entry that is no page", (cu, lens, bad_table)),
                       ("a length past the block table", (cu, too_long, table)),
                       ("offsets out of order", (backwards, lens, table)),
                       ("offsets past the rows", (past_end, lens, table))):
        call(*args)
        try:
            fmha.check_device_errors()
            print(f"{name}: NOT flagged")
            ok = False
        except ValueError as e:
            print(f"{name}: flagged ({str(e)[:60]}...)")
    return ok


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    if "--claim-only" in sys.argv:
        return 0 if claimed_tiles_case(dev) else 1
    if "--mixed-only" in sys.argv:
        return 0 if mixed_batch_cases(dev, fp8="--fp8" in sys.argv) else 1
    ok = True
    q = torch.randn(1, 200, 2, 64, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, 200, 1, 64, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, 200, 1, 64, device=dev, dtype=torch.bfloat16)
    o, lse = fmha.attention(q, k, v, causal=True, return_lse=True, backend="kernel")
    ref, ref_lse = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True))
    err = ((o.float() - ref).norm() / ref.norm()).item()
    print(f"dense causal: rel L2 {err:.2e}, lse max abs {(lse - ref_lse).abs().max().item():.2e}")
    ok &= err < 1e-2

    # D=128 runs two consumer warpgroups, D=64 three: both turn-taking schemes get checked.
    # 1100 keys: query tiles of 1..9 key tiles (the overlapped loop's shortest and longer rows),
    # in the snake order of the causal grid. The grid is cut to 8 CTAs so that each runs 4-5
    # tiles and cycles through both Q buffers.
    from fmha.jit.launch import persistent_grid_of

    q = torch.randn(1, 1100, 4, 128, device=dev, dtype=torch.float16)
    k = torch.randn(1, 1100, 2, 128, device=dev, dtype=torch.float16)
    v = torch.randn(1, 1100, 2, 128, device=dev, dtype=torch.float16)
    with persistent_grid_of(8, torch.cuda.current_device()):
        o = fmha.attention(q, k, v, causal=True, mask_align="bottom_right", backend="kernel", persistent=True)
    ref, _ = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True, mask_align="bottom_right"))
    err = ((o.float() - ref).norm() / ref.norm()).item()
    print(f"dense causal D=128 persistent (8 CTAs, 36 tiles): rel L2 {err:.2e}")
    ok &= err < 1e-2
    ok &= claimed_tiles_case(dev)

    lens = [0, 1, 77, 130]
    cu = torch.tensor([0, 0, 1, 78, 208], dtype=torch.int32, device=dev)
    qv = torch.randn(208, 2, 64, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(208, 1, 64, device=dev, dtype=torch.bfloat16)
    vv = torch.randn(208, 1, 64, device=dev, dtype=torch.bfloat16)
    o = fmha.attention_varlen(qv, kv, vv, cu, cu, max(lens), max(lens), causal=True, backend="kernel")
    ref, _ = attention_reference(qv, kv, vv, cu, cu, mask=MaskSpec.from_args(causal=True))
    err = ((o.float() - ref).norm() / ref.norm()).item()
    print(f"varlen causal: rel L2 {err:.2e}")
    ok &= err < 1e-2

    # fp8 (staged V, fp8 A operand), head dims 32 and 256.
    # 700 / 670 keys: odd lengths, ragged last tiles (the staging kernel runs for fp8).
    for dtype, d, tol in [(torch.float8_e4m3fn, 128, 5e-2), (torch.bfloat16, 256, 1e-2), (torch.float16, 32, 1e-2)]:
        q = torch.randn(1, 700, 2, d, device=dev).to(dtype)
        k = torch.randn(1, 670, 1, d, device=dev).to(dtype)
        v = torch.randn(1, 670, 1, d, device=dev).to(dtype)
        o = fmha.attention(q, k, v, causal=True, mask_align="bottom_right", backend="kernel")
        ref, _ = attention_reference(q, k, v, mask=MaskSpec.from_args(causal=True, mask_align="bottom_right"))
        err = ((o.float() - ref).norm() / ref.norm()).item()
        print(f"{dtype} D={d} causal: rel L2 {err:.2e}")
        ok &= err < tol
    torch.cuda.synchronize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
