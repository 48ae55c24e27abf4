"""Small calls of NSA's fused top-k kernel (``kernels/common/block_topk.py``), for compute-sanitizer:

    compute-sanitizer --tool memcheck python -m lab.sanitize_topk

Varlen batches with empty and short sequences, inputs smaller than one tile (padded by the
runner), GQA groups of 1 to 64, and offsets that do not match the tensors (the op called without
the public function's checks): the kernel must stay in bounds on all of them. Exits 1 if a list
of a valid call names a block past its token's or holds a block twice (the GPU tests compare
the lists with the reference).

Run it once without the sanitizer first, so that the kernels load from the disk cache (see
``lab/sanitize_decode.py``)."""

import sys

import torch

import fmha.nsa as nsa

CASES = [  # (lens, H_q, H_k, D, block, stride, select_block, select_count)
    ([300, 0, 1, 77], 16, 2, 128, 32, 16, 64, 16),
    ([3, 0, 2], 2, 2, 64, 4, 2, 4, 2),
    ([200], 64, 1, 64, 32, 16, 64, 3),
    ([130, 5], 8, 8, 64, 16, 8, 32, 5),
]


def lists_are_sane(sel: torch.Tensor, cu: torch.Tensor, select_block: int) -> bool:
    rows = torch.arange(sel.shape[0], device=sel.device)
    pos = rows - cu[torch.searchsorted(cu[1:], rows, right=True)]
    current = (pos // select_block)[:, None, None]
    valid = sel >= 0
    if bool((valid & (sel > current)).any()):
        return False
    s = torch.where(valid, sel, torch.full_like(sel, 1 << 30)).sort(-1).values
    return not bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] < (1 << 30))).any())


def main() -> int:
    ok = True
    for lens, hq, hk, d, l, s, lsel, n in CASES:
        g = torch.Generator(device="cuda").manual_seed(sum(lens))
        total = sum(lens)
        q = torch.randn(total, hq, d, generator=g, device="cuda").to(torch.bfloat16)
        k = torch.randn(total, hk, d, generator=g, device="cuda").to(torch.bfloat16)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
        _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
        sel = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, backend="kernel")
        if not lists_are_sane(sel, cu, lsel):
            print(f"bad lists for {lens} {hq}/{hk} D={d}")
            ok = False
        # offsets that disagree with the tensors: wrong lists, but no access out of bounds
        bad_cu = cu.clone()
        bad_cu[1] = total + 500
        bad_cmp = cu_cmp.clone()
        bad_cmp[-1] = k_cmp.shape[0] + 900
        torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, bad_cu, bad_cmp, l, s, lsel, n, d ** -0.5, "kernel", 0)
    torch.cuda.synchronize()
    print("ok" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
