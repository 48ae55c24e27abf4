"""The varlen work-tile lists: every query tile with rows (the backward's: every K/V tile with
keys) exactly once, costliest first."""

import torch

from fmha.kernels.common.kv_walk import kv_walk
from fmha.masking import MaskSpec, row_key_bounds
from fmha.work_tiles import kv_work_tile_table, kv_work_tiles, work_tile_table, work_tiles

LENS_Q = [0, 1, 17, 300, 1024, 77, 129]
LENS_K = [5, 1, 0, 300, 1024, 700, 129]
MASKS = [MaskSpec(), MaskSpec.from_args(causal=True), MaskSpec.from_args(causal=True, mask_align="bottom_right"),
         MaskSpec.from_args(window_size=(100, 37))]


def _cost(b, m, mask, tm, tn):
    return kv_walk(m, tm, tn, LENS_Q[b], LENS_K[b], mask.kind, mask.window_left,
                            mask.window_right, mask.bottom_right).total


def test_every_tile_with_rows_once_and_costliest_first():
    for mask in MASKS:
        for tm, tn in [(128, 128), (192, 128), (128, 80)]:
            tiles = work_tiles(LENS_Q, LENS_K, mask, tm, tn)
            want = {(b, m) for b, s in enumerate(LENS_Q) for m in range(-(-s // tm))}
            assert sorted(tiles) == sorted(want) and len(tiles) == len(want)
            costs = [_cost(b, m, mask, tm, tn) for b, m in tiles]
            assert costs == sorted(costs, reverse=True)


def test_table_is_cached_and_never_empty():
    mask = MaskSpec.from_args(causal=True)
    t1 = work_tile_table(LENS_Q, LENS_K, mask, 128, 128, torch.device("cpu"))
    assert t1.dtype == torch.int32 and t1.shape == (len(work_tiles(LENS_Q, LENS_K, mask, 128, 128)), 2)
    assert work_tile_table(LENS_Q, LENS_K, mask, 128, 128, torch.device("cpu")) is t1
    empty = work_tile_table([0, 0], [3, 0], mask, 128, 128, torch.device("cpu"))
    assert empty.tolist() == [[0, 0]]  # a tile of an empty sequence: the kernel skips it


def _query_tiles_visiting(b, n, mask, tm, tn):
    """Query tiles of sequence ``b`` with a row that keeps a key of K/V tile ``n``, row by row."""
    sq, sk = LENS_Q[b], LENS_K[b]
    count = 0
    for m in range(-(-sq // tm)):
        for r in range(m * tm, min(m * tm + tm, sq)):
            lo, hi = row_key_bounds(r, sq, sk, mask.kind, mask.window_left, mask.window_right, mask.bottom_right)
            if max(lo, n * tn) < min(hi, n * tn + tn):
                count += 1
                break
    return count


def test_backward_lists_every_kv_tile_once_and_costliest_first():
    for mask in MASKS + [MaskSpec.from_args(compressed_causal=True)]:
        for tm, tn in [(64, 128), (128, 128)]:
            tiles = kv_work_tiles(LENS_Q, LENS_K, mask, tm, tn)
            # every K/V tile with keys, also those no row keeps (they write dK = dV = 0)
            want = {(b, n) for b, s in enumerate(LENS_K) for n in range(-(-s // tn))}
            assert sorted(tiles) == sorted(want) and len(tiles) == len(want)
            costs = [_query_tiles_visiting(b, n, mask, tm, tn) for b, n in tiles]
            assert costs == sorted(costs, reverse=True), (mask, tm, tn)


def test_backward_table_is_cached_apart_from_the_forward_one():
    mask = MaskSpec.from_args(causal=True)
    kv = kv_work_tile_table(LENS_Q, LENS_K, mask, 64, 128, torch.device("cpu"))
    assert kv.dtype == torch.int32 and kv.tolist() == [list(t) for t in kv_work_tiles(LENS_Q, LENS_K, mask, 64, 128)]
    assert kv_work_tile_table(LENS_Q, LENS_K, mask, 64, 128, torch.device("cpu")) is kv
    assert work_tile_table(LENS_Q, LENS_K, mask, 64, 128, torch.device("cpu")) is not kv
    assert kv_work_tile_table([3], [0], mask, 64, 128, torch.device("cpu")).tolist() == [[0, 0]]


def test_tables_are_cached_per_stream_and_held_for_captured_graphs(monkeypatch):
    """A table is made and read on one stream (another stream gets its own), and under CUDA-graph
    capture a cached table is held for good while a new one stays out of the cache (its copy runs
    only at replay). The stream and capture probes are stand-ins: no GPU here."""
    from fmha import work_tiles as wt

    state = {"stream": 1, "capturing": False}
    monkeypatch.setattr(wt, "_stream_of", lambda device: state["stream"])
    monkeypatch.setattr(wt, "_capturing", lambda device: state["capturing"])
    monkeypatch.setattr(wt, "_HELD_BY_GRAPHS", {})
    mask = MaskSpec.from_args(causal=True)
    cpu = torch.device("cpu")
    lens = ([77, 300], [77, 300])
    on_1 = work_tile_table(*lens, mask, 128, 128, cpu)
    state["stream"] = 2
    on_2 = work_tile_table(*lens, mask, 128, 128, cpu)
    assert on_2 is not on_1 and torch.equal(on_2, on_1)
    assert work_tile_table(*lens, mask, 128, 128, cpu) is on_2
    state["capturing"] = True
    assert work_tile_table(*lens, mask, 128, 128, cpu) is on_2  # cached: its copy has run
    assert wt._HELD_BY_GRAPHS[on_2.data_ptr()][0] is on_2
    state["stream"] = 3  # a capture stream: a table of another stream serves (the capture synchronized)
    assert work_tile_table(*lens, mask, 128, 128, cpu) in (on_1, on_2)
    assert len(wt._HELD_BY_GRAPHS) == 1 or on_1.data_ptr() in wt._HELD_BY_GRAPHS
    captured = work_tile_table([5, 9], [5, 9], mask, 128, 128, cpu)  # new under capture
    assert wt._HELD_BY_GRAPHS[captured.data_ptr()][0] is captured
    state["capturing"] = False
    assert work_tile_table([5, 9], [5, 9], mask, 128, 128, cpu) is not captured  # never cached
