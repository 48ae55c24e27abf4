"""The shared mask/tile logic against brute force over the rules of docs/semantics.md."""

import random

import pytest

from fmha.kernels.common.kv_walk import kv_walk, query_walk
from fmha.masking import MaskKind, MaskSpec, first_row_past, row_key_bounds


def spec_keeps(i, j, sq, sk, spec):
    """The semantics' predicate, written independently of fmha.masking."""
    if j >= sk or i >= sq:
        return False
    if spec.kind == MaskKind.NONE:
        return True
    if spec.kind == MaskKind.COMPRESSED_CAUSAL:
        if spec.compression is not None:  # summary j covers tokens [j * stride, j * stride + block)
            block, stride = spec.compression
            return j * stride + block - 1 <= i
        c = sq // sk
        return j <= (i + 1) // c - 1
    off = sk - sq if spec.bottom_right else 0
    if spec.window_left is not None and j < i + off - spec.window_left:
        return False
    if spec.window_right is not None and j > i + off + spec.window_right:
        return False
    return True


def random_spec(rng, sq, sk):
    kind = rng.choice(list(MaskKind))
    if kind == MaskKind.COMPRESSED_CAUSAL:
        if rng.random() < 0.5:  # NSA's geometry: any lengths
            block = rng.choice([1, 2, 4, 5, 8, 16, 32])
            stride = rng.choice([s for s in (1, 2, 3, 4, 8, 16) if s <= block] + [block])
            return MaskSpec(kind, compression=(block, stride))
        if sk == 0 or sk > sq:
            return MaskSpec(MaskKind.NONE)
        return MaskSpec(kind)
    if kind == MaskKind.NONE:
        return MaskSpec(kind)
    w = lambda: rng.choice([None, 0, 1, 3, 17, 64, 100, 200])
    left, right = w(), w()
    return MaskSpec(MaskKind.WINDOW, left, right, rng.random() < 0.5)


def test_row_bounds_match_spec():
    rng = random.Random(0)
    for _ in range(400):
        sq, sk = rng.randint(1, 70), rng.randint(0, 70)
        spec = random_spec(rng, sq, sk)
        for i in range(sq):
            lo, hi = row_key_bounds(i, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right,
                                    compression=spec.compression)
            kept = {j for j in range(sk) if spec_keeps(i, j, sq, sk, spec)}
            assert kept == set(range(lo, hi)), (sq, sk, spec, i)


def test_first_row_past_matches_a_scan_of_the_bands():
    """The backward kernel's query range per K/V tile: the closed form against every row's band."""
    rng = random.Random(1)
    for _ in range(600):
        sq, sk = rng.randint(1, 90), rng.randint(1, 90)
        spec = random_spec(rng, sq, sk)
        bands = [row_key_bounds(i, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right,
                                compression=spec.compression) for i in range(sq)]
        for key in range(sk):
            for use_lo in (False, True):
                want = next((i for i, band in enumerate(bands) if band[0 if use_lo else 1] > key), sq)
                got = first_row_past(key, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right,
                                     use_lo, compression=spec.compression)
                assert got == want, (sq, sk, spec, key, use_lo)


def test_backward_query_ranges_invert_the_forward_schedules():
    """The backward kernel's query tiles per K/V tile (``query_walk``) are exactly the (query
    tile, K/V tile) pairs the forward's ``kv_walk`` visits: the K/V tiles that add into a query
    tile's dQ are the ones its forward visited."""
    rng = random.Random(3)
    for _ in range(1500):
        tm, tn = rng.choice([(64, 128), (128, 128), (4, 8), (8, 4), (3, 5)])
        sq, sk = rng.randint(1, 300), rng.randint(1, 300)
        spec = random_spec(rng, sq, sk)
        args = (sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right)
        pairs = set()
        for n in range((sk + tn - 1) // tn):
            walk = query_walk(n, tm, tn, *args, compression=spec.compression)
            assert walk.count >= 0
            pairs |= {(m, n) for m in range(walk.start, walk.end)}
        want = set()
        for m in range((sq + tm - 1) // tm):
            sched = kv_walk(m, tm, tn, *args, compression=spec.compression)
            want |= {(m, n) for n in range(sched.start, sched.start + sched.total)}
        assert pairs == want, (sq, sk, tm, tn, spec)


@pytest.mark.parametrize("seed", range(6))
def test_tile_schedule_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(120):
        tm, tn = rng.choice([(4, 4), (8, 4), (4, 8), (16, 8), (64, 128), (128, 128), (128, 64), (3, 5)])
        sq, sk = rng.randint(1, 300), rng.randint(0, 300)
        spec = random_spec(rng, sq, sk)
        for m in range((sq + tm - 1) // tm):
            rows = range(m * tm, min((m + 1) * tm, sq))
            sched = kv_walk(m, tm, tn, sq, sk, spec.kind, spec.window_left, spec.window_right, spec.bottom_right,
                            compression=spec.compression)
            assert min(sched) >= 0
            assert [sched.block(k) for k in range(sched.total)] == list(range(sched.start, sched.start + sched.total))
            visited = range(sched.start, sched.start + sched.total)
            for n in range((sk + tn - 1) // tn + 2):
                cols = range(n * tn, (n + 1) * tn)
                kept = [[spec_keeps(i, j, sq, sk, spec) for j in cols] for i in rows]
                any_kept = any(any(r) for r in kept)
                all_kept = all(all(r) for r in kept)
                ctx = (sq, sk, tm, tn, spec, m, n, sched)
                # a tile is visited iff some row keeps some column of it
                assert (n in visited) == any_kept, ctx
                if n in visited:
                    k = n - sched.start
                    unmasked = sched.leading_masked <= k < sched.leading_masked + sched.unmasked
                    # a tile is marked unmasked iff every row keeps all of it
                    assert unmasked == all_kept, ctx
                    assert sched.needs_mask(k) == (not all_kept), ctx
            # the three segments, in order, are the walk's steps with their classes
            classes = [True] * sched.leading_masked + [False] * sched.unmasked + [True] * sched.trailing_masked
            assert classes == [bool(sched.needs_mask(k)) for k in range(sched.total)]


def test_mask_spec_from_args():
    assert MaskSpec.from_args() == MaskSpec(MaskKind.NONE)
    assert MaskSpec.from_args(causal=True).is_causal
    assert MaskSpec.from_args(window_size=(None, 0)).is_causal
    s = MaskSpec.from_args(causal=True, window_size=(16, None), mask_align="bottom_right")
    assert (s.kind, s.window_left, s.window_right, s.bottom_right) == (MaskKind.WINDOW, 16, 0, True)
    assert MaskSpec.from_args(compressed_causal=True).kind == MaskKind.COMPRESSED_CAUSAL
    # negative sides are band offsets (FlashAttention-4's convention)
    s = MaskSpec.from_args(window_size=(-1, 0))
    assert (s.kind, s.window_left, s.window_right) == (MaskKind.WINDOW, -1, 0)
    assert MaskSpec.from_args(window_size=(None, -5)).window_right == -5
    # causal clips the window's right side to 0
    assert MaskSpec.from_args(causal=True, window_size=(None, 4)).is_causal
    s = MaskSpec.from_args(causal=True, window_size=(8, -3))
    assert (s.window_left, s.window_right) == (8, -3)
    with pytest.raises(ValueError, match="window_size left must be an int or None"):
        MaskSpec.from_args(window_size=(1.5, 0))
    with pytest.raises(ValueError, match="mask_align"):
        MaskSpec.from_args(mask_align="center")
    with pytest.raises(ValueError, match="compressed_causal cannot be combined"):
        MaskSpec.from_args(causal=True, compressed_causal=True)
    s = MaskSpec.from_args(compressed_causal=(32, 16))
    assert (s.kind, s.compression) == (MaskKind.COMPRESSED_CAUSAL, (32, 16))
    assert MaskSpec.from_args(compressed_causal=True).compression is None
    assert s.describe() == "compressed_causal(block=32,stride=16)"
    for bad in ((32,), (0, 16), (32, -1), (32.0, 16), "32,16", (True, 1)):
        with pytest.raises(ValueError, match="compressed_causal"):
            MaskSpec.from_args(compressed_causal=bad)


def test_compression_geometry_is_nsa_visibility():
    """Row t keeps compressed key j exactly when block j's last token, j * stride + block - 1,
    is at or before t; block = stride = c is the ratio form with S_q = c * S_k."""
    for block, stride in ((32, 16), (8, 4), (5, 3), (4, 4), (1, 1), (3, 5)):
        for sq, sk in ((100, 7), (1, 3), (64, 0), (200, 200)):
            for t in range(sq):
                lo, hi = row_key_bounds(t, sq, sk, MaskKind.COMPRESSED_CAUSAL, compression=(block, stride))
                assert lo == 0 and hi == len([j for j in range(sk) if j * stride + block - 1 <= t])
    for c, sk in ((4, 9), (16, 3)):
        sq = c * sk
        for t in range(sq):
            assert (row_key_bounds(t, sq, sk, MaskKind.COMPRESSED_CAUSAL)
                    == row_key_bounds(t, sq, sk, MaskKind.COMPRESSED_CAUSAL, compression=(c, c)))


def test_kept_column_bits_match_the_interval():
    """The per-thread bit masks of ``FragmentMask`` (one bit per column a thread holds in a row of a
    warpgroup-MMA accumulator) keep exactly the columns in ``[lo, hi)``, for bounds before, inside
    and past each 32-column chunk (the kernel evaluates the same function with PTX shifts)."""
    from fmha.kernels.common.mask import CHUNK, column_offset, kept_column_bits

    assert [column_offset(i) for i in range(6)] == [0, 1, 8, 9, 16, 17]
    for chunk in range(2):
        for lo in range(-9, 270, 1):
            for hi in range(-9, 270, 5):
                bits = kept_column_bits(lo, hi, chunk)
                got = [bool(bits >> i & 1) for i in range(CHUNK)]
                want = [lo <= column_offset(CHUNK * chunk + i) < hi for i in range(CHUNK)]
                assert got == want, (chunk, lo, hi)


def test_a_mask_mod_without_a_block_mask_masks_every_tile_of_the_walk():
    """``masked_for_mods``: the walk every kernel takes with mods. A mask mod alone can drop any
    key, so every visited tile is masked (same tiles, same order); with a block mask, or with a
    score mod only, the band walk stays as it is."""
    from fmha.kernels.common.kv_walk import KvWalk, mask_mod_on_every_tile, masked_for_mods
    from fmha.mods import ModsSignature

    walk = KvWalk(3, 1, 5, 2)
    mask_only = ModsSignature(None, object(), (), False)
    assert mask_mod_on_every_tile(mask_only)
    masked = masked_for_mods(walk, mask_only)
    assert (masked.total, masked.unmasked) == (walk.total, 0)
    assert [masked.block(i) for i in range(masked.total)] == [walk.block(i) for i in range(walk.total)]
    assert all(masked.needs_mask(i) for i in range(masked.total))
    for mods in (None, ModsSignature(object(), None, (), False), ModsSignature(None, object(), (), True)):
        assert not mask_mod_on_every_tile(mods) and masked_for_mods(walk, mods) == walk
