"""Online softmax in base 2 over register fragments, shared by the kernels.

Scores arrive unscaled (raw q.k in fp32). With ``s2 = scale * log2(e)`` the probabilities are
``exp2(S * s2 - max * s2)``, one FMA and one ``ex2`` per element. The running max is kept in raw
score units (the scale is positive; the host refuses kernels otherwise), the running sum is kept
per thread and only reduced across the row's four threads at the end.

A row that has seen only masked scores has max -inf; it is treated as max 0 so that every
exp2 gives exactly 0 and no -inf - -inf = NaN appears. Its sum stays 0, which ``finalize`` turns
into O = 0 and LSE = -inf (docs/semantics.md).

With ``max_slack`` > 0 the running max is a stale bound: a row keeps the max it has unless a new
tile exceeds it by more than ``max_slack`` (in log2 units, so probabilities stay <= 2^max_slack).
The result is the same (every probability, the sum and the output carry the same factor, which
``finalize`` divides out, and the LSE is taken against the max actually used), but after the
first tiles of a row its max rarely moves, the output's correction factor is exactly 1, and
``rescale`` skips the multiplications when no row of the warp moved.
"""

import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .fragments import as_rows_cols

# Threads of a warpgroup MMA accumulator that share a row: lanes 4r .. 4r + 3.
_THREADS_PER_ROW = 4
# Independent accumulation chains per row for the max and for the sum (see ``update``).
MAX_CHAINS = 4
SUM_CHAINS = 2
# How far (log2 units) a row's max may be stale: probabilities stay <= 256, which bf16, fp16 and
# e4m3 (max 448) all hold, and an fp32 row sum of 2^8 per key cannot overflow.
MAX_SLACK = 8.0


def _add(a, b):
    return a + b


def _tree(values: list, op):
    """Combine ``values`` pairwise (depth log2(n) instead of n - 1)."""
    while len(values) > 1:
        values = [op(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                  for i in range(0, len(values), 2)]
    return values[0]


# Frozen: read-only for the DSL's loop analysis; the register tensors it holds are still mutable.
@dataclass(frozen=True)
class OnlineSoftmax:
    scale_log2: Float32
    row_max: cute.Tensor
    row_sum: cute.Tensor
    max_chains: int = MAX_CHAINS
    sum_chains: int = SUM_CHAINS
    max_slack: float = 0.0

    @staticmethod
    def create(scale_log2: Float32, num_rows: int, max_chains: int = MAX_CHAINS,
               sum_chains: int = SUM_CHAINS, max_slack: float = 0.0) -> "OnlineSoftmax":
        return OnlineSoftmax(
            scale_log2,
            cute.make_rmem_tensor(num_rows, Float32),
            cute.make_rmem_tensor(num_rows, Float32),
            max_chains,
            sum_chains,
            max_slack,
        )

    @cute.jit
    def reset(self):
        self.row_max.fill(-math.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def update(self, acc_s: cute.Tensor, row_scale: cute.Tensor):
        """Turn scores ``acc_s`` into unnormalized probabilities in place and fold them into the
        running max/sum. ``row_scale`` receives the factor the output accumulator must be
        multiplied by (``rescale``) before this tile's P.V is added to it.

        The rows are processed side by side, phase by phase (local max, quad shuffle, exp2), and
        each row's max is a tree over ``max_chains`` independent chains (its sum over
        ``sum_chains``): during a consumer warpgroup's softmax its warp is often the only one its
        scheduler can issue from, so the latency of a 32-long dependent chain would be exposed
        in full."""
        s = as_rows_cols(acc_s)
        num_rows = cute.size(s, mode=[0])
        local_max = self._row_maxes(s)
        for r in cutlass.range_constexpr(num_rows):
            prev_max = self.row_max[r]
            cur_max = local_max[r]
            if cutlass.const_expr(self.max_slack > 0.0):
                # Keep the stale max unless the new one is far above it (the bound comes from the
                # old max alone, so only a compare and a select wait for the new one). A first
                # visit (-inf before) moves to any finite max; a row still all -inf stays so.
                if not (cur_max > prev_max + Float32(self.max_slack) / self.scale_log2):
                    cur_max = prev_max
            self.row_max[r] = cur_max
            safe_max = cur_max
            if cur_max == Float32(-math.inf):
                safe_max = Float32(0.0)
            neg_max_scaled = -safe_max * self.scale_log2
            # prev_max = -inf (first visit) gives exp2(-inf) = 0: nothing to carry over.
            correction = cute.math.exp2((prev_max - safe_max) * self.scale_log2, fastmath=True)
            tile_sum = self._exponentiate_row(s, r, neg_max_scaled)
            self.row_sum[r] = self.row_sum[r] * correction + tile_sum
            row_scale[r] = correction

    def _row_maxes(self, s: cute.Tensor) -> list:
        """Each row's max over this tile (rows x cols view ``s``) and its running max, as a tree
        over ``max_chains`` chains, then across the row's four threads. Plain Python loops,
        unrolled while the calling ``cute.jit`` method is traced."""
        num_cols = cute.size(s, mode=[1])
        chains = min(self.max_chains, num_cols)
        local_max = []
        for r in range(cute.size(s, mode=[0])):
            part = [s[r, c] for c in range(chains)]
            part[0] = cute.arch.fmax(part[0], self.row_max[r])
            for c in range(chains, num_cols):
                part[c % chains] = cute.arch.fmax(part[c % chains], s[r, c])
            local_max.append(_tree(part, cute.arch.fmax))
        for r in range(len(local_max)):
            local_max[r] = cute.arch.warp_reduction_max(local_max[r], threads_in_group=_THREADS_PER_ROW)
        return local_max

    def _exponentiate_row(self, s: cute.Tensor, r: int, neg_max_scaled) -> Float32:
        """``s[r, c] = exp2(s[r, c] * scale_log2 + neg_max_scaled)`` in place for this thread's
        columns of row ``r`` (``neg_max_scaled``: minus the finite row max, scaled); returns their
        sum, a tree over ``sum_chains`` chains."""
        num_cols = cute.size(s, mode=[1])
        sum_chains = min(self.sum_chains, num_cols)
        part = [None] * sum_chains
        for c in range(num_cols):
            p = cute.math.exp2(s[r, c] * self.scale_log2 + neg_max_scaled, fastmath=True)
            s[r, c] = p
            k = c % sum_chains
            part[k] = p if c < sum_chains else part[k] + p
        return _tree(part, _add)

    @cute.jit
    def rescale(self, acc_o: cute.Tensor, row_scale: cute.Tensor):
        if cutlass.const_expr(self.max_slack > 0.0):
            moved = row_scale[0] != Float32(1.0)
            for r in cutlass.range_constexpr(1, cute.size(row_scale)):
                moved = moved | (row_scale[r] != Float32(1.0))
            # One vote per warp keeps the branch uniform.
            if cute.arch.vote_any_sync(moved):
                self._multiply_rows(acc_o, row_scale)
        else:
            self._multiply_rows(acc_o, row_scale)

    @cute.jit
    def _multiply_rows(self, acc_o: cute.Tensor, row_scale: cute.Tensor):
        o = as_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * row_scale[r]

    @cute.jit
    def finalize(self, acc_o: cute.Tensor, output_scale: Float32, lse_out: cute.Tensor,
                 sinks_log2: Optional[cute.Tensor] = None):
        """Normalize ``acc_o`` by the row sums (times ``output_scale``) and write each row's
        natural-log LSE of the scaled scores into ``lse_out`` (one entry per fragment row).
        ``sinks_log2``: each row's sink logit in log2 units (-inf: none), or None (static)."""
        o = as_rows_cols(acc_o)
        for r in cutlass.range_constexpr(cute.size(o, mode=[0])):
            total = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=_THREADS_PER_ROW)
            sink = None if cutlass.const_expr(sinks_log2 is None) else sinks_log2[r]
            lse, inv = row_lse_and_inverse(self.row_max[r], total, self.scale_log2, output_scale, sink)
            lse_out[r] = lse
            for c in cutlass.range_constexpr(cute.size(o, mode=[1])):
                o[r, c] = o[r, c] * inv


@cute.jit
def finite_row_max(row_max: Float32) -> Float32:
    """The max a row's exponentials are taken against: its running max, or 0 while that is still
    -inf (every score masked so far), so that exp2 gives exactly 0 and never -inf - -inf = NaN."""
    safe = row_max
    if row_max == Float32(-math.inf):
        safe = Float32(0.0)
    return safe


@cute.jit
def row_lse_and_inverse(row_max: Float32, row_sum: Float32, scale_log2: Float32, output_scale: Float32,
                        sink_log2=None):
    """(natural-log LSE of the scaled scores, factor that normalizes the row's O) for a row whose
    probabilities exp2((s - row_max) * scale_log2) sum to ``row_sum``; a row that kept nothing
    (sum 0) gets (-inf, 0) (docs/semantics.md). ``sink_log2`` (a dynamic value, -inf for none, or
    None when the kernel has no sinks): a logit in log2 units that joins the denominator and the
    LSE but adds no value row; a row with only the sink gets (the sink, 0)."""
    inv = Float32(0.0)
    lse = Float32(-math.inf)
    if cutlass.const_expr(sink_log2 is None):
        if row_sum > Float32(0.0):
            inv = output_scale / row_sum
            lse = (row_max * scale_log2 + cute.math.log2(row_sum, fastmath=True)) * Float32(math.log(2.0))
    else:
        # against the larger of the row's max and the sink, so that neither exponential overflows
        max_log2 = row_max * scale_log2
        top = cute.arch.fmax(max_log2, sink_log2)
        if top > Float32(-math.inf):
            keys_part = cute.math.exp2(max_log2 - top, fastmath=True)
            total = row_sum * keys_part + cute.math.exp2(sink_log2 - top, fastmath=True)
            inv = output_scale * keys_part / total
            lse = (top + cute.math.log2(total, fastmath=True)) * Float32(math.log(2.0))
    return lse, inv
