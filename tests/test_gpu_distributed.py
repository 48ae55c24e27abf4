"""Context-parallel attention on two Hopper GPUs (marked ``gpu``; skipped without two SM90 GPUs):
two NCCL processes, each holding its shard of one sequence (or of packed documents), run
``fmha.distributed`` with the kernels (``backend="kernel"``: no silent fallback to the reference);
the shards of the output, LSE and gradients, gathered and put back in order, are judged against
the exact reference on the whole sequence (fp32 compute, ``backend="reference"``) by the rules of
the kernels' own GPU check (tests/gpu_cases.py): relative L2 error of O below ``O_TOL``, of dQ, dK
and dV below ``BACKWARD_TOL``, LSE within ``LSE_TOL`` on every row that keeps a key. Single-GPU
fmha on the whole sequence is judged by the same rules, and its errors are printed beside ours.

    python -m pytest -m gpu tests/test_gpu_distributed.py -s
"""

import datetime
import itertools
import os
import socket

import pytest
import torch

import fmha
from fmha import distributed as cp
from gpu_cases import BACKWARD_TOL, LSE_TOL, O_TOL

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.device_count() >= 2
         and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(2))),
    reason="needs two Hopper (SM90) GPUs")]

S = 8192  # the whole sequence: 4096 rows per rank
HQ = 8
# (layout, mask, method, head dim, K/V heads): zigzag and contiguous, causal / none / windows,
# GQA, both methods, D = 128 and 64, few enough kernel configurations to compile quickly
DENSE = [("zigzag", dict(causal=True), "ring", 128, 2),
         ("contiguous", dict(causal=True), "ring", 128, 8),
         ("zigzag", dict(), "ring", 128, 8),
         ("zigzag", dict(window_size=(1500, 0)), "ring", 128, 2),
         ("contiguous", dict(window_size=(700, 300)), "all_gather", 128, 8),
         ("zigzag", dict(causal=True), "all_gather", 128, 2),
         ("contiguous", dict(), "ring", 64, 4)]
# packed documents (lengths multiples of 2 N = 4; one of 4 tokens, so chunks of one row; an empty one)
DOCS = (3000, 4, 0, 1020, 2048, 2120)
VARLEN = [("zigzag", True, "ring", 128, 2), ("contiguous", True, "all_gather", 128, 8),
          ("zigzag", False, "ring", 128, 8)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(shape_q, shape_k, seed, device):
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(shape_q, generator=g) for _ in range(2))
    k, v = (torch.randn(shape_k, generator=g) for _ in range(2))
    return [t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v, dout)]


def _rel_l2(got, want) -> float:
    got, want = got.float(), want.float()
    return ((got - want).nan_to_num(nan=1e30).norm() / want.norm().clamp_min(1e-30)).item()


def _errors(got, want) -> dict:
    """The GPU check's measures: relative L2 of o, dq, dk, dv; max |LSE error| over finite rows."""
    finite = torch.isfinite(want[1])
    lse_err = (got[1][finite] - want[1][finite]).abs().max().item() if finite.any() else 0.0
    same_inf = bool(torch.equal(torch.isneginf(got[1]), torch.isneginf(want[1])))
    errs = {name: _rel_l2(g, w) for name, g, w in zip(("o", "dq", "dk", "dv"), got[:1] + got[2:], want[:1] + want[2:])}
    return dict(errs, lse=lse_err if same_inf else float("inf"))


def _gather(t, world):
    everyone = [torch.empty_like(t) for _ in range(world)]
    torch.distributed.all_gather(everyone, t.contiguous())
    return everyone


def _full(fn, inputs, dout, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, lse = fn(*leaves, return_lse=True, **kw)
    o.backward(dout)
    return [o.detach(), lse.detach()] + [t.grad for t in leaves]


def _worker(rank, world, port, results, seqlen=S, docs=DOCS, device="cuda", kernel="kernel"):
    """One rank: every case's gathered errors into ``results[rank]``. (``device="cpu"`` with gloo
    and ``kernel="reference"`` runs the same code on the CPU, at small ``seqlen``/``docs``.)"""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
        # a rank that fails mid-ring is ended by the parent; the timeout bounds the wait otherwise
        # (a kernel compile on one rank, 10-30 s, is the longest legitimate wait)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank),
                                timeout=datetime.timedelta(minutes=5))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    try:
        for i, (layout, mask, method, d, hk) in enumerate(DENSE):
            q, k, v, dout = _inputs((1, seqlen, HQ, d), (1, seqlen, hk, d), i, device)
            mine = [cp.shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
            o, lse = cp.context_parallel_attention(*mine, layout=layout, method=method, return_lse=True,
                                                   backend=kernel, **mask)
            o.backward(cp.shard(dout, rank, world, layout))
            got = [cp.unshard(_gather(t, world), layout, dim=2 if j == 1 else 1)
                   for j, t in enumerate([o.detach(), lse] + [t.grad for t in mine])]
            ref = _full(fmha.attention, (q, k, v), dout, backend="reference", **mask)
            one = _full(fmha.attention, (q, k, v), dout, backend=kernel, **mask)
            out[f"dense {layout} {mask or 'none'} {method} D{d} H{HQ}/{hk}"] = (_errors(got, ref), _errors(one, ref))
        cu = torch.tensor([0, *itertools.accumulate(docs)], dtype=torch.int32, device=device)
        for i, (layout, causal, method, d, hk) in enumerate(VARLEN):
            q, k, v, dout = _inputs((sum(docs), HQ, d), (sum(docs), hk, d), 100 + i, device)
            mine = [cp.shard_varlen(t, cu, rank, world, layout).requires_grad_() for t in (q, k, v)]
            o, lse = cp.context_parallel_attention_varlen(*mine, cu, causal=causal, layout=layout, method=method,
                                                          return_lse=True, backend=kernel)
            o.backward(cp.shard_varlen(dout, cu, rank, world, layout))
            got = [cp.unshard_varlen(_gather(t, world), cu, layout, dim=1 if j == 1 else 0)
                   for j, t in enumerate([o.detach(), lse] + [t.grad for t in mine])]
            ref = _full(fmha.attention_varlen, (q, k, v), dout, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                        backend="reference")
            one = _full(fmha.attention_varlen, (q, k, v), dout, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal,
                        backend=kernel)
            out[f"varlen {layout} {'causal' if causal else 'none'} {method} D{d} H{HQ}/{hk}"] = (
                _errors(got, ref), _errors(one, ref))
        results[rank] = out
    except Exception as e:  # reported by the test, with the traceback of the rank
        import traceback

        results[rank] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        raise
    finally:
        dist.destroy_process_group()


def test_two_gpus_agree_with_the_reference_like_one_gpu():
    import torch.multiprocessing as mp

    manager = mp.Manager()
    results = manager.dict()
    try:
        mp.start_processes(_worker, args=(2, _free_port(), results), nprocs=2, join=True, start_method="spawn")
    except Exception:
        pytest.fail("a rank failed:\n" + "\n".join(str(results.get(r, "no result")) for r in range(2)))
    rows = results[0]  # both ranks judged the same gathered tensors
    failures = []
    tol = dict(o=O_TOL["bfloat16"], lse=LSE_TOL, dq=BACKWARD_TOL["bfloat16"], dk=BACKWARD_TOL["bfloat16"],
               dv=BACKWARD_TOL["bfloat16"])
    print("\ncase: two GPUs (one GPU) errors against the reference")
    for name, (two, one) in rows.items():
        print(f"{name}: " + ", ".join(f"{m} {two[m]:.2e} ({one[m]:.2e})" for m in tol))
        failures += [f"{name}: {m} {two[m]:.3e} >= {tol[m]}" for m in tol if not two[m] < tol[m]]
    assert not failures, failures
    assert len(rows) == len(DENSE) + len(VARLEN)
