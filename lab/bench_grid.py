"""The points ``lab.bench`` times: one shape, mask and dtype a ``Point``, and the named grids."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Point:
    batch: int
    seqlen: int
    heads_q: int
    heads_k: int
    head_dim: int
    causal: bool
    group: str = "standard"
    dtype: str = "bfloat16"  # or float8_e4m3fn (fmha only; output bf16)
    window_left: int | None = None  # sliding window (window_left, 0) when set
    varlen: tuple | None = None  # per-sequence lengths (THD); batch/seqlen then unused

    def flops(self) -> float:
        """4 * H_q * D * (kept query-key pairs); causal with S_q == S_k keeps about half."""
        if self.varlen:
            pairs = sum(s * (s + 1) / 2 if self.causal else s * s for s in self.varlen)
        elif self.window_left is not None:
            w, s = self.window_left, self.seqlen
            pairs = self.batch * sum(min(i, w) + 1 for i in range(s))
        else:
            pairs = self.batch * self.seqlen * self.seqlen / (2 if self.causal else 1)
        return 4.0 * self.heads_q * self.head_dim * pairs

    def label(self) -> str:
        shape = (f"varlen{len(self.varlen)} T{sum(self.varlen)} max{max(self.varlen)}"
                 if self.varlen else f"B{self.batch} S{self.seqlen}")
        return (f"{shape} H{self.heads_q}/{self.heads_k} D{self.head_dim}"
                f"{' causal' if self.causal else ''}"
                f"{f' window({self.window_left},0)' if self.window_left is not None else ''}"
                f"{' fp8' if self.dtype != 'bfloat16' else ''}")


def realistic_lengths(total: int = 16384, seed: int = 0) -> tuple:
    """Document lengths of a packed batch: log-normal (median ~700 tokens, a long tail), cut to
    ``total`` tokens; includes the short and odd lengths real batches have."""
    import random

    rng = random.Random(seed)
    lens = []
    while sum(lens) < total:
        lens.append(max(1, min(8192, int(rng.lognormvariate(6.5, 1.0)))))
    lens[-1] -= sum(lens) - total
    return tuple(x for x in lens if x > 0)


def build_grid(name: str) -> list[Point]:
    seqlens = [512, 1024, 2048, 4096, 8192, 16384]
    if name == "quick":
        return [Point(16384 // s, s, 2048 // d, 2048 // d, d, c)
                for d in (64, 128) for s in (1024, 8192) for c in (False, True)]
    pts = [Point(16384 // s, s, 2048 // d, 2048 // d, d, c)
           for d in (64, 128) for c in (False, True) for s in seqlens]
    if name == "standard":
        return pts
    pts += [Point(16384 // s, s, 16, 2, 128, c, "gqa8") for s in (2048, 8192) for c in (False, True)]
    pts += [Point(16384 // s, s, 8, 8, 256, c, "d256") for s in (2048, 8192) for c in (False, True)]
    pts += [Point(16384 // s, s, 16, 16, 128, True, "window1024", window_left=1024) for s in (4096, 16384)]
    pts += [Point(1, 0, 16, 16, 128, c, "varlen", varlen=realistic_lengths()) for c in (False, True)]
    pts += [Point(16384 // s, s, 16, 16, 128, c, "fp8", dtype="float8_e4m3fn")
            for s in (4096, 8192, 16384) for c in (False, True)]
    # the rest of issue #21's fp8 targets: D=256, and GQA
    pts += [Point(16384 // s, s, 8, 8, 256, c, "fp8", dtype="float8_e4m3fn")
            for s in (4096, 8192, 16384) for c in (False, True)]
    pts += [Point(2, 8192, 16, 2, 128, c, "fp8", dtype="float8_e4m3fn") for c in (False, True)]
    return pts


def extras_grid() -> list[Point]:
    """The non-standard groups only (``--grid extras``)."""
    return [p for p in build_grid("full") if p.group != "standard"]
