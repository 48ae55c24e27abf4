"""Context-parallel attention on the CPU: 2-4 processes with gloo, each holding its shard of one
sequence; every rank's output and gradients must equal the rows of single-process attention over
the whole sequence (the reference backend), for each layout and mask. Bad shards raise the same
error on every rank instead of hanging."""

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


def _worker(rank, world, port, seqlen, cases, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        q, k, v, dout = _inputs(seqlen)
        out = {}
        for i, (layout, mask, method) in enumerate(cases):
            qs, ks, vs = (cp.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v))
            o, lse = cp.context_parallel_attention(qs, ks, vs, layout=layout, return_lse=True, method=method, **mask)
            o.backward(cp.shard(dout, rank, world, layout))
            out[i] = (o.detach(), lse, qs.grad, ks.grad, vs.grad)
        errors = []
        bad_len = _inputs(seqlen + (2 * world if rank == 0 else 0))[:3]  # rank 0's shard is longer
        for name, call in (
                ("lengths", lambda: cp.context_parallel_attention(*(cp.shard(t, rank, world, "contiguous")
                                                                     for t in bad_len), layout="contiguous")),
                ("layout", lambda: cp.context_parallel_attention(
                    *(cp.shard(t, rank, world, "zigzag") for t in (q, k, v)),
                    layout="zigzag" if rank else "contiguous")),
                ("dtype", lambda: cp.context_parallel_attention(
                    *(cp.shard(t, rank, world).float() if rank == world - 1 else cp.shard(t, rank, world)
                      for t in (q, k, v))))):
            try:
                call()
                errors.append((name, None))
            except ValueError as e:
                errors.append((name, str(e)))
        results[rank] = (out, errors)
    finally:
        dist.destroy_process_group()


def _run(world, seqlen, cases):
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_worker, args=(world, _free_port(), seqlen, cases, results), nprocs=world, join=True,
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
    for r in range(world):
        errors = dict(results[r][1])
        assert "differ" in errors["lengths"] and "differ" in errors["layout"], errors
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
    block = cp._block_window(q_start, k_start, q_len, k_len, left, right)
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
