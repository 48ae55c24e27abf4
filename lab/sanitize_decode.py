"""Small decode calls over paged and dense KV caches through the kernel, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m lab.sanitize_decode
    compute-sanitizer --tool racecheck python -m lab.sanitize_decode

Pages shuffled, lengths not multiples of the page or the tile, block-table entries past a
sequence's pages set to -1 and to a page that does not exist (never read: they lie past the
lengths), rows past each length NaN, the keys split over CTAs and not. Exits 1 if an output
disagrees with the reference (the sanitizer reports its own findings).

Run it once without the sanitizer first, so that the kernels load from the disk cache: a kernel
compiled under memcheck adds the DSL's own driver probing to the report (``cuGetProcAddress``
returning CUDA_ERROR_INVALID_VALUE while it detects the GPU), which is not a finding."""

import sys

import torch

import fmha


def case(page_size: int, num_splits, seed: int) -> bool:
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hk, d, per_seq = 3, 8, 2, 128, 5
    lengths = torch.tensor([page_size * 3 + (5 % page_size), 1, page_size * per_seq], dtype=torch.int32, device="cuda")
    pages = b * per_seq + 1
    k = torch.randn(pages, page_size, hk, d, generator=g, device="cuda").to(torch.bfloat16)
    v = torch.randn(pages, page_size, hk, d, generator=g, device="cuda").to(torch.bfloat16)
    order = torch.randperm(b * per_seq, device="cuda").to(torch.int32)
    table = torch.full((b, per_seq + 2), -1, dtype=torch.int32, device="cuda")
    table[:, :per_seq] = order.view(b, per_seq)
    table[0, per_seq + 1] = pages + 100  # past every length: clamped, never flagged
    for i, n in enumerate(lengths.tolist()):  # rows past each length: NaN
        for p in range(per_seq):
            lo = max(0, n - p * page_size)
            if lo < page_size:
                k[table[i, p], lo:] = float("nan")
                v[table[i, p], lo:] = float("nan")
    q = torch.randn(b, 2, hq, d, generator=g, device="cuda").to(torch.bfloat16)
    out, lse = fmha.attention_with_kvcache(q, k, v, lengths, block_table=table, return_lse=True,
                                           num_splits=num_splits, backend="kernel")
    fmha.check_device_errors()
    ref, ref_lse = fmha.attention_with_kvcache(q, k, v, lengths, block_table=table, return_lse=True,
                                               backend="reference")
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    empty = torch.isneginf(ref_lse)  # rows that keep no key (sequence 1's first row)
    finite = ~empty
    ok = (err < 1e-2 and not out.isnan().any() and torch.equal(torch.isneginf(lse), empty)
          and (lse[finite] - ref_lse[finite]).abs().max().item() < 1e-3)
    print(f"paged {page_size} splits {num_splits}: rel L2 {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    return ok


def main() -> int:
    ok = all([case(16, 1, 0), case(16, 3, 1), case(48, None, 2), case(256, 2, 3), case(1, 1, 4), case(1, 3, 5),
              case(7, None, 6)])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
