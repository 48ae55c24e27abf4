"""Context-parallel attention on the CPU: 2-4 processes with gloo, each holding its shard of one
sequence (or of packed documents); every rank's output, LSE and gradients must equal the rows of
single-process attention over the whole sequence (the reference backend), for each layout and
mask. Bad shards raise the same error on every rank instead of hanging. The ring steps' plans
(one local call where the kept blocks allow it) keep exactly what the full mask keeps, once."""

import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fmha import distributed as cp

B, HQ, HK, D = 1, 4, 2, 32
MASKS = [dict(causal=True), dict(causal=False), dict(window_size=(40, 0)), dict(window_size=(16, 9))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(seqlen, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, seqlen, HQ, D, generator=g).to(torch.bfloat16)
    k = torch.randn(B, seqlen, HK, D, generator=g).to(torch.bfloat16)
    v = torch.randn(B, seqlen, HK, D, generator=g).to(torch.bfloat16)
    dout = torch.randn(B, seqlen, HQ, D, generator=g).to(torch.bfloat16)
    return q, k, v, dout


def _count_local_calls():
    """Count the local calls fmha.distributed makes (in this worker process)."""
    counts = dict(forward=0, backward=0)

    def counted(fn, key):
        def call(*args, **kwargs):
            counts[key] += 1
            return fn(*args, **kwargs)
        return call

    cp.api.attention = counted(cp.api.attention, "forward")
    cp.api.attention_varlen = counted(cp.api.attention_varlen, "forward")
    cp.api.attention_backward = counted(cp.api.attention_backward, "backward")
    return counts


def _errors_of(calls) -> list:
    """(name, the ValueError's message or None) of each (name, call)."""
    errors = []
    for name, call in calls:
        try:
            call()
            errors.append((name, None))
        except ValueError as e:
            errors.append((name, str(e)))
    return errors


def _worker(rank, world, port, seqlen, cases, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        q, k, v, dout = _inputs(seqlen)
        out = {}
        counts = _count_local_calls()
        for i, (layout, mask, method) in enumerate(cases):
            before = dict(counts)
            qs, ks, vs = (cp.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v))
            o, lse = cp.context_parallel_attention(qs, ks, vs, layout=layout, return_lse=True, method=method, **mask)
            o.backward(cp.shard(dout, rank, world, layout))
            out[i] = (o.detach(), lse, qs.grad, ks.grad, vs.grad, {n: counts[n] - before[n] for n in counts})
        bad_len = _inputs(seqlen + (2 * world if rank == 0 else 0))[:3]  # rank 0's shard is longer
        errors = _errors_of((
            ("lengths", lambda: cp.context_parallel_attention(*(cp.shard(t, rank, world, "contiguous")
                                                                 for t in bad_len), layout="contiguous")),
            ("layout", lambda: cp.context_parallel_attention(
                *(cp.shard(t, rank, world, "zigzag") for t in (q, k, v)),
                layout="zigzag" if rank else "contiguous")),
            ("dtype", lambda: cp.context_parallel_attention(
                *(cp.shard(t, rank, world).float() if rank == world - 1 else cp.shard(t, rank, world)
                  for t in (q, k, v))))))
        results[rank] = (out, errors)
    finally:
        dist.destroy_process_group()


def _run(world, seqlen, cases, worker=_worker):
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(worker, args=(world, _free_port(), seqlen, cases, results), nprocs=world, join=True,
                       start_method="spawn")
    return dict(results)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_rank_gets_its_rows_of_the_full_attention_and_gradients(world):
    import fmha

    seqlen = 2 * world * 24  # zigzag chunks of 24 rows: not a multiple of any tile
    cases = [(layout, mask, "ring") for layout in cp.LAYOUTS for mask in MASKS]
    cases += [("zigzag", MASKS[0], "all_gather"), ("contiguous", MASKS[3], "all_gather")]
    results = _run(world, seqlen, cases)
    q, k, v, dout = _inputs(seqlen)
    for i, (layout, mask, _) in enumerate(cases):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want_o, want_lse = fmha.attention(*leaves, return_lse=True, **mask)
        want_o.backward(dout)
        want = [want_o.detach(), want_lse.detach()] + [t.grad for t in leaves]
        for name, got_shards, full in zip(("o", "lse", "dq", "dk", "dv"), zip(*(results[r][0][i]
                                                                              for r in range(world))), want):
            dim = 2 if name == "lse" else 1
            got = cp.unshard(list(got_shards), layout, dim=dim)
            finite = torch.isfinite(full) if name == "lse" else torch.ones_like(full, dtype=torch.bool)
            tol = 1e-4 if name == "lse" else 2e-2
            assert torch.allclose(got.float()[finite], full.float()[finite], atol=tol, rtol=tol), (layout, mask, name)
        # one local call per ring step where the kept blocks allow it (zigzag causal or no mask,
        # contiguous any mask), one per kept block for zigzag windows
        calls = [results[r][0][i][5] for r in range(world)]
        assert all(c["forward"] == c["backward"] for c in calls), calls
        one_per_step = layout == "contiguous" or "window_size" not in mask
        assert max(c["forward"] for c in calls) <= world if one_per_step else \
            max(c["forward"] for c in calls) > world, (layout, mask, calls)
    for r in range(world):
        errors = dict(results[r][1])
        assert "differ" in errors["lengths"] and "differ" in errors["layout"], errors
        # each differing item by name, with every rank's value of it, and only those
        assert "layout: rank 0 'contiguous', rank 1 'zigzag'" in errors["layout"], errors
        assert "q_shape: rank 0" in errors["lengths"] and "layout:" not in errors["lengths"], errors
        assert f"rank {world - 1}: TypeError" in errors["dtype"], errors


def test_layouts_round_trip_and_balance_causal_work():
    x = torch.arange(2 * 4 * 5).reshape(1, 40, 1, 1)
    for layout in cp.LAYOUTS:
        shards = [cp.shard(x, r, 4, layout) for r in range(4)]
        assert torch.equal(cp.unshard(shards, layout), x)
    zig = [cp.shard(x, r, 4, "zigzag").flatten().tolist() for r in range(4)]
    assert zig[0] == list(range(0, 5)) + list(range(35, 40))
    causal_pairs = [sum(p + 1 for p in rows) for rows in zig]  # keys each rank's rows attend to
    assert max(causal_pairs) == min(causal_pairs)
    with pytest.raises(ValueError, match="multiple of 8"):
        cp.shard(torch.zeros(1, 36, 1, 1), 0, 4, "zigzag")


@pytest.mark.parametrize("q_start,k_start,q_len,k_len,left,right", [
    (0, 0, 24, 24, None, 0), (48, 0, 24, 24, None, 0), (0, 48, 24, 24, None, 0), (48, 24, 24, 24, 40, 0),
    (24, 48, 24, 24, 16, 9), (100, 0, 24, 24, 40, 0), (30, 10, 8, 24, 3, 2), (0, 0, 24, 24, None, None)])
def test_block_windows_keep_exactly_what_the_full_mask_keeps(q_start, k_start, q_len, k_len, left, right):
    i = torch.arange(q_len)[:, None] + q_start
    j = torch.arange(k_len)[None, :] + k_start
    want = torch.ones(q_len, k_len, dtype=torch.bool)
    if left is not None:
        want &= j >= i - left
    if right is not None:
        want &= j <= i + right
    block = cp.plan._block_window(q_start, k_start, q_len, k_len, left, right)
    got = torch.zeros_like(want)
    if block is not None:
        first_row, first_key, (ll, rr) = block
        ii = torch.arange(q_len - first_row)[:, None]
        jj = torch.arange(k_len - first_key)[None, :]
        keep = torch.ones(ii.shape[0], jj.shape[1], dtype=torch.bool)
        if ll is not None:
            keep &= jj >= ii - ll
        if rr is not None:
            keep &= jj <= ii + rr
        got[first_row:, first_key:] = keep
    assert torch.equal(got, want)
    assert (block is None) == (not want.any())


# ---------------------------------------------------------------------------- packed documents

VARLEN_CHUNKS = (5, 1, 0, 12, 3)  # documents' lengths in units of 2 N tokens: a 2 N-token one, an empty one


def _varlen_inputs(world, seed=1):
    lens = [c * 2 * world for c in VARLEN_CHUNKS]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    g = torch.Generator().manual_seed(seed)
    t = int(cu[-1])
    q, k, v, dout = (torch.randn(t, h, D, generator=g).to(torch.bfloat16) for h in (HQ, HK, HK, HQ))
    return cu, q, k, v, dout


def _varlen_worker(rank, world, port, _seqlen, cases, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        cu, q, k, v, dout = _varlen_inputs(world)
        out = {}
        counts = _count_local_calls()
        for i, (layout, causal, method) in enumerate(cases):
            before = dict(counts)
            qs, ks, vs = (cp.shard_varlen(t, cu, rank, world, layout).requires_grad_() for t in (q, k, v))
            o, lse = cp.context_parallel_attention_varlen(qs, ks, vs, cu, causal=causal, layout=layout,
                                                          return_lse=True, method=method)
            o.backward(cp.shard_varlen(dout, cu, rank, world, layout))
            out[i] = (o.detach(), lse, qs.grad, ks.grad, vs.grad, {n: counts[n] - before[n] for n in counts})
        mine = [cp.shard_varlen(t, cu, rank, world, "zigzag") for t in (q, k, v)]
        odd = cu.clone()
        odd[1] += 1  # the first two documents no longer cut into equal chunks
        swapped = torch.tensor([0, *itertools.accumulate(reversed(cu.diff().tolist()))], dtype=torch.int32)
        errors = _errors_of((
            ("odd", lambda: cp.context_parallel_attention_varlen(*mine, odd, causal=True)),
            ("differ", lambda: cp.context_parallel_attention_varlen(*mine, swapped if rank == 0 else cu)),
            ("window", lambda: cp.context_parallel_attention_varlen(*mine, cu, window_size=(8, 0)))))
        results[rank] = (out, errors)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_packed_documents_across_ranks_equal_single_process_varlen_attention(world):
    import fmha

    cases = [(layout, causal, "ring") for layout in cp.LAYOUTS for causal in (True, False)]
    cases += [("zigzag", True, "all_gather"), ("contiguous", False, "all_gather")]
    results = _run(world, None, cases, worker=_varlen_worker)
    cu, q, k, v, dout = _varlen_inputs(world)
    for i, (layout, causal, method) in enumerate(cases):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        want_o, want_lse = fmha.attention_varlen(*leaves, cu, cu, causal=causal, return_lse=True)
        want_o.backward(dout)
        want = [want_o.detach(), want_lse.detach()] + [t.grad for t in leaves]
        for name, got_shards, full in zip(("o", "lse", "dq", "dk", "dv"), zip(*(results[r][0][i]
                                                                              for r in range(world))), want):
            got = cp.unshard_varlen(list(got_shards), cu, layout, dim=1 if name == "lse" else 0)
            finite = torch.isfinite(full) if name == "lse" else torch.ones_like(full, dtype=torch.bool)
            tol = 1e-4 if name == "lse" else 2e-2
            assert torch.allclose(got.float()[finite], full.float()[finite], atol=tol, rtol=tol), \
                (layout, causal, method, name)
        calls = [results[r][0][i][5] for r in range(world)]
        assert all(c["forward"] == c["backward"] <= world for c in calls), calls  # one varlen call per step
    for r in range(world):
        errors = dict(results[r][1])
        assert f"multiple of {2 * world}" in errors["odd"], errors
        assert "cu_seqlens differ" in errors["differ"], errors
        assert "sliding windows" in errors["window"], errors


def test_varlen_layouts_round_trip_and_refuse_uneven_documents():
    cu = torch.tensor([0, 8, 8, 24, 32], dtype=torch.int32)
    x = torch.arange(32).reshape(32, 1)
    for layout in cp.LAYOUTS:
        shards = [cp.shard_varlen(x, cu, r, 2, layout) for r in range(2)]
        assert all(s.shape[0] == 16 for s in shards)
        assert torch.equal(cp.unshard_varlen(shards, cu, layout), x)
    assert cp.shard_varlen(x, cu, 0, 2, "zigzag").flatten().tolist() == \
        [0, 1, 6, 7] + [8, 9, 10, 11, 20, 21, 22, 23] + [24, 25, 30, 31]
    assert cp.shard_varlen(x, cu, 1, 2, "contiguous").flatten().tolist() == \
        [4, 5, 6, 7] + list(range(16, 24)) + [28, 29, 30, 31]
    with pytest.raises(ValueError, match="document 1 has 6 tokens.*multiple of 4"):
        cp.shard_varlen(torch.zeros(16, 1), [0, 4, 10, 16], 0, 2, "zigzag")
    with pytest.raises(ValueError, match="multiple of 3"):
        cp.shard_varlen(torch.zeros(10, 1), [0, 10], 0, 3, "contiguous")


# ---------------------------------------------------------------------------- the ring steps' plans


def _kept(rows, keys, keep, q_pos, k_pos, total):
    """Add a call's kept (row, key) pairs, at their global positions, into a count matrix."""
    got = torch.zeros(total, total, dtype=torch.int64)
    got.index_put_((q_pos[rows][:, None].expand_as(keep)[keep], k_pos[keys][None, :].expand_as(keep)[keep]),
                   torch.ones(int(keep.sum()), dtype=torch.int64), accumulate=True)
    return got


def _positions(pieces, n):
    pos = torch.empty(n, dtype=torch.int64)
    for g, loc, length in pieces:
        pos[loc:loc + length] = torch.arange(g, g + length)
    return pos


@pytest.mark.parametrize("world", [2, 3, 4])
def test_each_ring_step_keeps_what_the_full_mask_keeps_exactly_once(world):
    """The (coalesced) local calls of every (rank, source shard) pair, mapped back to global
    positions, count every pair the full mask keeps once and nothing else."""
    s = 2 * world * 6
    total = s * world
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    for layout, (left, right) in itertools.product(cp.LAYOUTS, [(None, 0), (None, None), (40, 0), (16, 9), (0, 0),
                                                                (5, None)]):
        want = torch.ones(total, total, dtype=torch.int64)
        if left is not None:
            want &= (j >= i - left).long()
        if right is not None:
            want &= (j <= i + right).long()
        for rank, src in itertools.product(range(world), range(world)):
            q_pos = _positions(cp.segments(layout, rank, world, s), s)
            k_pos = _positions(cp.segments(layout, src, world, s), s)
            got = torch.zeros(total, total, dtype=torch.int64)
            calls = cp.plan._dense_calls(layout, rank, src, world, s, left, right)
            for call in calls:
                rows, keys = torch.arange(*call.rows), torch.arange(*call.keys)
                ll, rr = call.kw["window_size"]
                ii, jj = torch.arange(len(rows))[:, None], torch.arange(len(keys))[None, :]
                keep = torch.ones(len(rows), len(keys), dtype=torch.bool)
                if ll is not None:
                    keep &= jj >= ii - ll
                if rr is not None:
                    keep &= jj <= ii + rr
                got += _kept(rows, keys, keep, q_pos, k_pos, total)
            block = torch.zeros_like(want)
            block[q_pos[:, None], k_pos[None, :]] = want[q_pos[:, None], k_pos[None, :]]
            assert torch.equal(got, block), (layout, left, right, rank, src)
            if layout == "contiguous" or left is None and right in (0, None):
                assert len(calls) <= 1, (layout, left, right, rank, src, calls)


@pytest.mark.parametrize("world", [2, 3])
def test_each_varlen_ring_step_keeps_what_the_document_mask_keeps_exactly_once(world):
    lens = [c * 2 * world for c in VARLEN_CHUNKS]
    offsets = [0, *itertools.accumulate(lens)]
    cu = torch.tensor(offsets, dtype=torch.int32)
    total = offsets[-1]
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    i, j = torch.arange(total)[:, None], torch.arange(total)[None, :]
    for layout, causal in itertools.product(cp.LAYOUTS, (True, False)):
        want = (doc[:, None] == doc[None, :]).long()
        if causal:
            want &= (j <= i).long()
        for rank in range(world):
            shards = cp.plan._varlen_shards(layout, rank, world, offsets, cu, causal)
            q_pos = _positions(cp.layouts.varlen_segments(layout, rank, world, offsets), total // world)
            for src in range(world):
                k_pos = _positions(cp.layouts.varlen_segments(layout, src, world, offsets), total // world)
                got = torch.zeros(total, total, dtype=torch.int64)
                calls = shards.calls(src)
                assert len(calls) <= 1
                for call in calls:
                    kw = call.kw
                    rows, keys = (shards.index[sel] if isinstance(sel, str) else torch.arange(*sel)
                                  for sel in (call.rows, call.keys))
                    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
                    assert cq[-1] == len(rows) and ck[-1] == len(keys)
                    assert kw["max_seqlen_q"] == max(b - a for a, b in zip(cq, cq[1:]))
                    assert kw["max_seqlen_k"] == max(b - a for a, b in zip(ck, ck[1:]))
                    keep = torch.zeros(len(rows), len(keys), dtype=torch.bool)
                    for (a, b), (c, d) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
                        ii, jj = torch.arange(b - a)[:, None], torch.arange(d - c)[None, :]
                        keep[a:b, c:d] = (jj <= ii) if kw["causal"] else True
                    got += _kept(rows, keys, keep, q_pos, k_pos, total)
                block = torch.zeros_like(want)
                block[q_pos[:, None], k_pos[None, :]] = want[q_pos[:, None], k_pos[None, :]]
                assert torch.equal(got, block), (layout, causal, rank, src)


def test_the_two_gpu_benchmark_runs_on_the_cpu(tmp_path):
    """``lab.bench_context_parallel --smoke``: the same measurements with gloo at tiny sizes."""
    import json

    from lab import bench_context_parallel as bench

    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "context_parallel.json").read_text())
    assert len(report["rows"]) == 3 and (tmp_path / "context_parallel.md").exists()
    for row in report["rows"]:
        assert row["rel_l2_vs_one"] < 2e-2  # the two-rank output and gradients are the one-rank ones
        for key in ("one_fwd", "two_step", "compute_step", "comm_step", "kv_exchange", "merge", "ratio_step"):
            assert row[key] > 0, key
    assert report["rows"][0]["extrapolated_8"]["gpus"] == 8
