"""The last wave of the dense causal backward grid, modelled on the host (no GPU).

    python -m lab.grid_tail

One CTA per (sequence, K/V head, K/V tile); one CTA per SM (the backward's registers and shared
memory); a CTA costs the query tiles it visits plus ``--overhead`` (its K/V loads and dK/dV
stores, in query tiles), and the hardware starts CTAs in grid order on whichever SM frees first.
Prints, for the standard grid's causal points, the busiest SM's load over the average for the
library's order (K/V tiles fastest) and for the costliest-first order of the ``fmha_bwd_lpt``
variant (K/V heads and sequences fastest): the prediction a GPU run of the variant checks.
"""

import argparse
import heapq


def makespan(costs, sms: int) -> float:
    """Greedy list schedule: each CTA, in order, on the SM that frees first."""
    loads = [0.0] * sms
    for c in costs:
        heapq.heappush(loads, heapq.heappop(loads) + c)
    return max(loads)


def tails(batch: int, seqlen: int, heads: int, tile_m: int = 64, tile_n: int = 128, overhead: float = 1.0,
          sms: int = 132) -> tuple:
    num_n, num_m = -(-seqlen // tile_n), -(-seqlen // tile_m)
    cost = [num_m - (n * tile_n) // tile_m + overhead for n in range(num_n)]  # top-left causal
    library = [cost[n] for _ in range(batch * heads) for n in range(num_n)]
    costliest_first = [cost[n] for n in range(num_n) for _ in range(batch * heads)]
    mean = sum(library) / sms
    return makespan(library, sms) / mean, makespan(costliest_first, sms) / mean


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--overhead", type=float, default=1.0, help="a CTA's fixed cost, in query tiles")
    ap.add_argument("--sms", type=int, default=132)
    args = ap.parse_args(argv)
    print("| D | S | library order | costliest first |\n|---|---|---|---|")
    for d, heads in ((64, 32), (128, 16)):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            a, b = tails(16384 // s, s, heads, overhead=args.overhead, sms=args.sms)
            print(f"| {d} | {s} | {a:.3f} | {b:.3f} |")


if __name__ == "__main__":
    main()
