"""fmha.nsa on a CUDA GPU in bf16, at the paper's geometry (block 32, stride 16, selection
blocks of 64, 16 of them, window 512) and moderate sizes (about 3.6k packed tokens, D = 128, GQA
16/2 and 32/8), against the fp64 reference (``fmha.nsa.reference``) given the same bf16 inputs:
each branch, the top-k (a choice that differs from the reference's must be a near-tie by the
reference's own scores), the composition forward and backward, and a model's training losses.
On an SM90 GPU the window and compression branches must run on fmha's kernels (``backend=
"kernel"``). Marked ``gpu``; skipped without CUDA.

    python -m pytest -m gpu tests/test_gpu_nsa.py
"""

import pytest
import torch
import torch.nn.functional as F

import fmha
import fmha.nsa as nsa
from fmha.nsa import reference as ref
from gpu_cases import capture_graph
from gpu_checks import lse_max_err, rel_l2

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)

PAPER = dict(block=32, stride=16, select_block=64, select_count=16, window=512)
HEADS = [(16, 2), (32, 8)]
LENS = [2048 + 77, 0, 1, 1531]


def cu_of(lens, device):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def bf16_inputs(lens, hq, hk, d, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g, device=device).to(torch.bfloat16) for h in (hq, hk, hk))
    gates = tuple(torch.rand(total, hq, generator=g, device=device).to(torch.bfloat16) for _ in range(3))
    return q, k, v, gates, cu_of(lens, device)


def check_branches(device, lens, hq, hk, d, geometry, backend="auto"):
    """Compression, window and selection branches against the reference on the same inputs."""
    l, s, lsel, w = geometry["block"], geometry["stride"], geometry["select_block"], geometry["window"]
    q, k, v, _, cu = bf16_inputs(lens, hq, hk, d, device)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    v_cmp, _ = nsa.mean_pool(v, cu, l, s)
    o, lse_cmp = nsa.compression_attention(q, k_cmp, v_cmp, cu, cu_cmp, l, s, backend=backend)
    want_o, want_lse = ref.compression_attention_reference(q, k_cmp, v_cmp, cu, cu_cmp, l, s)
    assert o.dtype == torch.bfloat16 and rel_l2(o, want_o) < 1e-2 and lse_max_err(lse_cmp, want_lse) < 5e-3
    o, lse = nsa.window_attention(q, k, v, cu, w, backend=backend)
    want_o, want_lse = ref.window_attention_reference(q, k, v, cu, w)
    assert rel_l2(o, want_o) < 1e-2 and lse_max_err(lse, want_lse) < 5e-3
    sel = nsa.select_blocks(q, k_cmp, lse_cmp, cu, cu_cmp, l, s, lsel, geometry["select_count"])
    o, lse = nsa.selection_attention(q, k, v, sel, cu, lsel)
    want_o, want_lse = ref.selection_attention_reference(q, k, v, sel, cu, lsel)
    assert rel_l2(o, want_o) < 1e-2 and lse_max_err(lse, want_lse) < 5e-3


def reference_block_keys(q, k_cmp, cu, cu_cmp, l, s, lsel):
    """fp64 (T, H_k, max blocks) ranking keys by the definition: the selection scores, forced
    blocks (current, previous, first) above every score, -inf for blocks after the query."""
    hk = k_cmp.shape[1]
    group = q.shape[1] // hk
    lens, lens_cmp = (c.diff().tolist() for c in (cu, cu_cmp))
    n_max = max((n + lsel - 1) // lsel for n in lens)
    keys = torch.full((q.shape[0], hk, n_max), -float("inf"), dtype=torch.float64, device=q.device)
    r0 = c0 = 0
    for n, nc in zip(lens, lens_cmp):
        t = torch.arange(n, device=q.device)
        i, j = torch.arange(nc, device=q.device), torch.arange((n + lsel - 1) // lsel, device=q.device)
        s_ = torch.einsum("thd,chd->thc", q[r0:r0 + n].double(), k_cmp[c0:c0 + nc].double().repeat_interleave(group, 1))
        s_ = (s_ * q.shape[-1] ** -0.5).masked_fill((i[None, None] * s + l - 1 > t[:, None, None]), -float("inf"))
        p = torch.softmax(s_, -1).nan_to_num(0.0).view(n, hk, group, nc).sum(2)
        overlap = ((i[:, None] * s < (j[None] + 1) * lsel) & (i[:, None] * s + l > j[None] * lsel)).double()
        score = p @ overlap
        cur = (t // lsel)[:, None]
        forced = (j[None] == cur) | (j[None] == cur - 1) | (j[None] == 0)
        score = torch.where(forced[:, None], torch.full_like(score, 2.0 * group + 2), score)
        keys[r0:r0 + n, :, :len(j)] = torch.where((j[None] <= cur)[:, None], score, -float("inf"))
        r0, c0 = r0 + n, c0 + nc
    return keys


def check_topk(device, lens, hq, hk, d, geometry, backend="auto", dtype=torch.bfloat16):
    """The bf16 top-k picks the reference's blocks, or blocks whose reference scores add up to
    the best total within a near-tie margin."""
    l, s, lsel, n = geometry["block"], geometry["stride"], geometry["select_block"], geometry["select_count"]
    q, k, _, _, cu = bf16_inputs(lens, hq, hk, d, device, seed=1)
    q, k = q.to(dtype), k.to(dtype)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
    got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, backend=backend)
    want = ref.select_blocks_reference(q, k_cmp, cu, cu_cmp, l, s, lsel, n)
    keys = reference_block_keys(q, k_cmp, cu, cu_cmp, l, s, lsel)

    def total(sel):
        return torch.where(sel >= 0, keys.gather(-1, sel.long().clamp(min=0)), torch.zeros_like(keys[..., :n])).sum(-1)

    assert torch.equal((got >= 0).sum(-1), (want >= 0).sum(-1)), "the number of blocks taken differs"
    same = (got == want).all(-1)
    assert same.double().mean() > 0.9, f"only {same.double().mean():.3f} of the lists agree"
    margin = (total(want) - total(got)).max().item()
    assert margin < 1e-3 * (hq // hk), f"a differing choice is not a near-tie: its scores are {margin:.3g} short"


def check_nsa_forward_backward(device, lens, hq, hk, d, geometry):
    q, k, v, gates, cu = bf16_inputs(lens, hq, hk, d, device, seed=2)
    fast = tuple(t.clone().requires_grad_() for t in (q, k, v) + gates)
    o, br = nsa.nsa_attention(*fast, cu_seqlens=cu, return_branches=True, **geometry)
    slow = tuple(t.double().requires_grad_() for t in (q, k, v) + gates)
    want = ref.nsa_reference(*slow, cu_seqlens=cu, selected=br.selected, **geometry)
    assert o.dtype == torch.bfloat16 and rel_l2(o, want) < 1e-2
    dout = torch.randn_like(o)
    o.backward(dout)
    want.backward(dout.double())
    for name, a, b in zip(("q", "k", "v", "g_cmp", "g_slc", "g_win"), fast, slow):
        assert rel_l2(a.grad, b.grad) < 2e-2, f"d{name}: {rel_l2(a.grad, b.grad):.3g}"


def training_losses(device, dtype, implementation, shape=(2, 1024), hidden=512, heads=(16, 2), steps=3):
    torch.manual_seed(0)
    attn = nsa.NativeSparseAttention(hidden, heads[0], heads[1], 128, implementation=implementation, **PAPER)
    model = torch.nn.Sequential(torch.nn.Linear(64, hidden), attn, torch.nn.Linear(hidden, 64)).to(device, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator(device=device).manual_seed(1)
    x, y = (torch.randn(*shape, 64, generator=g, device=device).to(dtype) for _ in range(2))
    losses = []
    for _ in range(steps):
        loss = F.mse_loss(model(x).float(), y.float())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("hq,hk", HEADS)
def test_branches_in_bf16(hq, hk):
    check_branches("cuda", LENS, hq, hk, 128, PAPER)


@pytest.mark.skipif(not _HOPPER, reason="fmha's kernels need an SM90 GPU")
def test_window_and_compression_run_on_fmha_kernels():
    check_branches("cuda", LENS, 16, 2, 128, PAPER, backend="kernel")


@pytest.mark.parametrize("hq,hk", HEADS)
def test_topk_in_bf16(hq, hk):
    check_topk("cuda", LENS, hq, hk, 128, PAPER)


def _geometry(block, stride, select_block, select_count):
    return dict(block=block, stride=stride, select_block=select_block, select_count=select_count)


# (lens, H_q, H_k, D, geometry, dtype): groups 1 to 64, head dims 64 to 192, 1 to 32 blocks per
# token, compressed blocks over one to three selection blocks, inputs smaller than one tile
TOPK_KERNEL_CASES = [
    (LENS, 16, 2, 128, PAPER, torch.bfloat16),
    (LENS, 32, 8, 128, PAPER, torch.bfloat16),
    ([4100, 65, 0, 3], 64, 4, 128, _geometry(64, 64, 64, 16), torch.bfloat16),
    ([777, 1, 0, 300], 8, 8, 64, _geometry(16, 8, 32, 5), torch.bfloat16),
    ([1000], 64, 1, 64, _geometry(32, 16, 64, 3), torch.float16),
    ([1500, 2], 4, 2, 192, _geometry(64, 32, 32, 32), torch.float16),
    ([3, 0, 2], 2, 2, 64, _geometry(4, 2, 4, 2), torch.bfloat16),
    ([1200, 900], 64, 8, 96, _geometry(32, 16, 64, 1), torch.bfloat16),
]


@pytest.mark.skipif(not _HOPPER, reason="fmha's kernels need an SM90 GPU")
@pytest.mark.parametrize("case", range(len(TOPK_KERNEL_CASES)))
def test_the_topk_kernel_against_the_reference(case):
    lens, hq, hk, d, geometry, dtype = TOPK_KERNEL_CASES[case]
    check_topk("cuda", lens, hq, hk, d, geometry, backend="kernel", dtype=dtype)


@pytest.mark.parametrize("hq,hk", HEADS)
def test_nsa_forward_and_backward_in_bf16(hq, hk):
    check_nsa_forward_backward("cuda", LENS, hq, hk, 128, PAPER)


def test_dense_batch_in_bf16():
    q, k, v, gates, _ = bf16_inputs([2048] * 2, 16, 2, 128, "cuda", seed=3)
    dense = [t.view(2, 2048, *t.shape[1:]) for t in (q, k, v) + gates]
    o, br = nsa.nsa_attention(*dense, return_branches=True, **PAPER)
    want = ref.nsa_reference(*dense, selected=br.selected, **PAPER)
    assert o.shape == (2, 2048, 16, 128) and rel_l2(o, want) < 1e-2


def test_model_training_in_bf16_tracks_the_fp64_reference():
    losses = training_losses("cuda", torch.bfloat16, "fmha")
    want = training_losses("cuda", torch.float64, "reference")
    assert losses == pytest.approx(want, rel=2e-2)
    assert losses[-1] < losses[0]


@pytest.mark.skipif(not _HOPPER, reason="fmha's kernels need an SM90 GPU")
@pytest.mark.parametrize("hq,hk", HEADS)
def test_selection_on_fmha_kernels_forward_and_backward(hq, hk):
    """``selection_attention(backend="kernel")``: the top-k's lists as a block mask and a mask mod
    on fmha's forward and backward kernels, against the fp64 reference (an unwritten output
    element would be a NaN or garbage the comparison catches)."""
    l, s, lsel, n = PAPER["block"], PAPER["stride"], PAPER["select_block"], PAPER["select_count"]
    q, k, v, _, cu = bf16_inputs(LENS, hq, hk, 128, "cuda", seed=4)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    _, lse_cmp = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
    sel = nsa.select_blocks(q, k_cmp, lse_cmp, cu, cu_cmp, l, s, lsel, n)
    leaves = tuple(t.clone().requires_grad_() for t in (q, k, v))
    o, lse = nsa.selection_attention(*leaves, sel, cu, lsel, backend="kernel")
    slow = tuple(t.double().requires_grad_() for t in (q, k, v))
    want_o, want_lse = ref.selection_attention_reference(*slow, sel, cu, lsel)
    assert not o.isnan().any() and rel_l2(o, want_o) < 1e-2 and lse_max_err(lse, want_lse) < 5e-3
    dout = torch.randn_like(o)
    o.backward(dout)
    want_o.backward(dout.double())
    for name, a, b in zip("qkv", leaves, slow):
        assert rel_l2(a.grad, b.grad) < 2e-2, f"d{name}: {rel_l2(a.grad, b.grad):.3g}"


def _decode_case(hq, hk, s_q, seed=7):
    """Caches of three sequences (their tokens before the step), the step's rows and new keys, and
    the fp64 reference's branches over the whole sequences."""
    lens, d, l, s = [2048 + 77, 3, 1531], 128, PAPER["block"], PAPER["stride"]
    q, k, v, gates, cu = bf16_inputs(lens, hq, hk, d, "cuda", seed=seed)
    s_max = max(lens) + 64
    n_cmp = nsa.num_compressed_blocks(s_max, l, s)
    b = len(lens)
    kc, vc = (torch.zeros(b, s_max, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kcmp, vcmp = (torch.zeros(b, n_cmp, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    idx = []
    for i, (a, n) in enumerate(zip(cu[:-1].tolist(), lens)):
        kc[i, :n - s_q], vc[i, :n - s_q] = k[a:a + n - s_q], v[a:a + n - s_q]
        pooled_k, _ = nsa.mean_pool(k[a:a + n - s_q], cu_of([n - s_q], "cuda"), l, s)
        pooled_v, _ = nsa.mean_pool(v[a:a + n - s_q], cu_of([n - s_q], "cuda"), l, s)
        kcmp[i, :pooled_k.shape[0]], vcmp[i, :pooled_v.shape[0]] = pooled_k, pooled_v
        idx.append([a + n - s_q + r for r in range(s_q)])
    idx = torch.tensor(idx, device="cuda")
    step = dict(q=q[idx], k_cache=kc, v_cache=vc, k_cmp_cache=kcmp, v_cmp_cache=vcmp,
                cache_seqlens=torch.tensor([n - s_q for n in lens], dtype=torch.int32, device="cuda"),
                g_cmp=gates[0][idx], g_slc=gates[1][idx], g_win=gates[2][idx], k_new=k[idx], v_new=v[idx])
    return step, (q, k, v, gates, cu), idx


@pytest.mark.skipif(not _HOPPER, reason="fmha's decode kernels need an SM90 GPU")
@pytest.mark.parametrize("hq,hk,s_q", [(16, 2, 1), (32, 8, 1), (16, 2, 3)])
def test_decode_step_in_bf16_on_the_kernels(hq, hk, s_q):
    """``nsa_decode`` with its two attention calls on fmha's decode kernels: each step row against
    the fp64 reference's last rows of the whole sequences, given the lists the step chose (which
    must be the reference's own for nearly every row and group: a broken ranking would not be)."""
    step, full, idx = _decode_case(hq, hk, s_q)
    o, got = nsa.nsa_decode(**step, backend="kernel", return_branches=True, **PAPER)
    q, k, v, gates, cu = full
    _, want_br = ref.nsa_reference(q, k, v, *gates, cu_seqlens=cu, return_branches=True, **PAPER)
    same = (got.selected == want_br.selected[idx]).all(-1).float().mean().item()
    assert same > 0.9, f"only {same:.2%} of the lists equal the reference's"
    sel = want_br.selected.clone()
    sel[idx] = got.selected
    want = ref.nsa_reference(q, k, v, *gates, cu_seqlens=cu, selected=sel, **PAPER)[idx]
    assert o.dtype == torch.bfloat16 and not o.isnan().any() and rel_l2(o, want) < 1e-2
    for name in ("o_cmp", "o_win"):
        assert rel_l2(getattr(got, name), getattr(want_br, name)[idx]) < 1e-2, name


@pytest.mark.skipif(not _HOPPER, reason="fmha's decode kernels need an SM90 GPU")
def test_decode_step_replays_in_a_cuda_graph():
    """A step captured once replays to the eager step's output, bit for bit."""
    step, _, _ = _decode_case(16, 2, 1, seed=9)
    eager = nsa.nsa_decode(**step, backend="kernel", **PAPER)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nsa.nsa_decode(**step, backend="kernel", **PAPER)  # warm: every kernel compiled before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = nsa.nsa_decode(**step, backend="kernel", **PAPER)
    torch.cuda.current_stream().wait_stream(stream)
    rows, pos = torch.arange(captured.shape[0], device="cuda"), step["cache_seqlens"].long()
    step["k_cache"][rows, pos] = float("nan")  # the new key's slot: only a replayed append restores it
    step["v_cache"][rows, pos] = float("nan")
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(step["k_cache"][rows, pos], step["k_new"][:, 0])
    assert torch.equal(step["v_cache"][rows, pos], step["v_new"][:, 0])
    assert torch.equal(captured, eager)


def _replays_to_eager(run, inputs, fresh):
    """Capture ``run(*inputs)`` in a CUDA graph, copy ``fresh`` into ``inputs``, replay: the
    captured output must equal an eager call on ``fresh`` bit for bit."""
    outputs = []
    graph = capture_graph(lambda: outputs.append(run(*inputs)), torch)
    captured = outputs[-1]  # the capture's output, which each replay rewrites
    for dst, src in zip(inputs, fresh):
        dst.copy_(src)
    captured.fill_(-7 if captured.dtype == torch.int32 else float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, run(*fresh))


@pytest.mark.parametrize("backend", ["auto", pytest.param("kernel", marks=pytest.mark.skipif(
    not _HOPPER, reason="fmha's kernels need an SM90 GPU"))])
def test_topk_replays_in_a_cuda_graph(backend):
    """The top-k reads nothing on the host, on the PyTorch path and on its kernel: a packed
    batch with empty and length-1 sequences."""
    lens, l, s, lsel, n = [1300, 0, 1, 877], 32, 16, 64, 16
    q, k, _, _, cu = bf16_inputs(lens, 16, 2, 128, "cuda", seed=4)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
    q2, _, _, _, _ = bf16_inputs(lens, 16, 2, 128, "cuda", seed=5)
    _, lse2 = nsa.compression_attention(q2, k_cmp, k_cmp, cu, cu_cmp, l, s)

    def run(q, lse):
        return torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, 128 ** -0.5, backend,
                                                max(lens))
    _replays_to_eager(run, (q, lse), (q2, lse2))
    assert torch.equal(run(q2, lse2), nsa.select_blocks(q2, k_cmp, lse2, cu, cu_cmp, l, s, lsel, n, backend=backend))


def test_the_top_k_op_flags_a_max_seqlen_below_the_longest_sequence():
    """On the GPU the op reads no offsets on the host: a too-small bound raises the device flag."""
    lens, l, s, lsel, n = [300, 0, 1, 177], 32, 16, 64, 16
    q, k, _, _, cu = bf16_inputs(lens, 16, 2, 128, "cuda", seed=6)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
    fmha.check_device_errors()
    torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, 128 ** -0.5, "auto", 300)
    fmha.check_device_errors()  # the longest sequence's own length is no error
    torch.ops.fmha_nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, 128 ** -0.5, "auto", 299)
    with pytest.raises(ValueError, match="max_seqlen"):
        fmha.check_device_errors()


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_select_blocks_with_max_seqlen_does_not_wait_for_the_gpu(backend):
    """``select_blocks(..., max_seqlen=)`` reads no offsets on the host (no synchronizing call,
    torch.cuda.set_sync_debug_mode) and gives the lists of the host-checked call; offsets that
    disagree with the tensors set the device flag and read nothing out of bounds."""
    lens, l, s, lsel, n = [700, 0, 1, 433], 32, 16, 64, 16
    q, k, _, _, cu = bf16_inputs(lens, 16, 2, 128, "cuda", seed=7)
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, l, s)
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_cmp, l, s)
    want = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, backend=backend)
    fmha.check_device_errors()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = nsa.select_blocks(q, k_cmp, lse, cu, cu_cmp, l, s, lsel, n, backend=backend, max_seqlen=max(lens))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
    fmha.check_device_errors()
    for bad_cu, bad_cmp in ((cu, cu_cmp + 1), (cu.flip(0), cu_cmp)):
        nsa.select_blocks(q, k_cmp, lse, bad_cu, bad_cmp, l, s, lsel, n, backend=backend, max_seqlen=max(lens))
        with pytest.raises(ValueError, match="cu_seqlens"):
            fmha.check_device_errors()


@pytest.mark.skipif(not _HOPPER, reason="fmha's kernels need an SM90 GPU")
def test_dense_nsa_forward_replays_in_a_cuda_graph():
    """Dense NSA reads nothing on the host: pooling, the three branches, the top-k and the gates
    replay from one capture."""
    def dense(seed):
        q, k, v, gates, _ = bf16_inputs([1100] * 2, 16, 2, 128, "cuda", seed=seed)
        return tuple(t.view(2, 1100, *t.shape[1:]) for t in (q, k, v) + gates)

    def run(*tensors):
        with torch.no_grad():
            return nsa.nsa_attention(*tensors, **PAPER)
    _replays_to_eager(run, dense(6), dense(7))


SELECTION_CASES = [  # (lengths, H_q, H_k, D, D_v, select_block, count, dtype)
    ([2048 + 77, 0, 1, 1531], 16, 2, 128, 128, 64, 16, torch.bfloat16),
    ([4099], 64, 4, 128, 128, 64, 16, torch.bfloat16),
    ([333, 1, 0, 1000], 8, 4, 64, 64, 32, 8, torch.float16),
    ([1500, 77], 4, 2, 128, 64, 128, 6, torch.bfloat16),
    ([700, 5], 2, 1, 192, 128, 16, 20, torch.bfloat16),
]


def _selection_inputs(lens, hq, hk, d, dv, lsel, n, dt, seed):
    """Random q, k, v and lists: the forced current, previous and first blocks, random earlier
    ones, future ones and -1s, and (n > 2) a block named twice (an unchecked list)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hq, d, generator=g, device="cuda").to(dt)
    k = torch.randn(total, hk, d, generator=g, device="cuda").to(dt)
    v = torch.randn(total, hk, dv, generator=g, device="cuda").to(dt)
    cu = cu_of(lens, "cuda")
    pos = torch.cat([torch.arange(x, device="cuda") for x in lens])
    blocks = (torch.cat([torch.full((x,), x, device="cuda") for x in lens]) + lsel - 1) // lsel
    scores = torch.rand(total, hk, int(blocks.max()) if total else 1, generator=g, device="cuda")
    idx = torch.arange(scores.shape[-1], device="cuda").view(1, 1, -1)
    cur = (pos // lsel).view(-1, 1, 1)
    scores = torch.where(idx >= blocks.view(-1, 1, 1), -1.0, scores)  # past the sequence: never
    scores = torch.where((idx == cur) | (idx == cur - 1) | (idx == 0), 2.0, scores)
    sel = scores.topk(min(n, scores.shape[-1]), dim=-1).indices.int()
    sel = torch.where(scores.gather(-1, sel.long()) < 0, -1, sel)
    sel[::7, :, -1] = -1
    if n > 2:
        sel[1::5, :, -1] = sel[1::5, :, -2]
    return q, k, v, sel, cu


def _without_repeats(sel, n):
    """The lists with ``_selection_inputs``' repeated block dropped (the reference would count it
    twice; the kernels count it once)."""
    dedup = sel.clone()
    if n > 2:
        dedup[1::5, :, -1] = -1
    return dedup


@pytest.mark.skipif(not _HOPPER, reason="the selection kernel needs an SM90 GPU")
@pytest.mark.parametrize("case", range(len(SELECTION_CASES)))
def test_the_selection_kernel_against_the_reference(case):
    """The selection kernel (each query tile of a few tokens' GQA heads walks their own blocks)
    on random lists (the forced current, previous and first blocks, random earlier ones, future
    ones and -1s, a block named twice), against the fp64 reference; the kernel's packed outputs
    are allocated where NaN-filled tensors of their sizes were just freed, so an element it did
    not write shows."""
    from fmha.backends import SELECTION, runner_for, unsupported_reasons
    from fmha.nsa.selection_visits import SelectionProblem
    from fmha.problem import KernelOptions

    lens, hq, hk, d, dv, lsel, n, dt = SELECTION_CASES[case]
    q, k, v, sel, cu = _selection_inputs(lens, hq, hk, d, dv, lsel, n, dt, seed=case)
    total = sum(lens)
    problem = SelectionProblem.of(q, k, v, lsel)
    chosen, reasons = unsupported_reasons(problem, KernelOptions(), kind=SELECTION)
    assert chosen is not None, reasons
    runner = runner_for(SELECTION, chosen, problem, KernelOptions())
    poison = [torch.full((1, total * hq // hk, hk, dv), float("nan"), dtype=dt, device="cuda"),
              torch.full((1, hk, total * hq // hk), float("nan"), device="cuda")]
    del poison
    o, lse = runner(problem, q, k, v, sel, cu, d ** -0.5)
    torch.cuda.synchronize()
    dedup = _without_repeats(sel, n)
    want_o, want_lse = ref.selection_attention_reference(q.double(), k.double(), v.double(), dedup, cu, lsel,
                                                          softmax_scale=d ** -0.5)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert rel_l2(o, want_o) < 1e-2 and lse_max_err(lse, want_lse) < 5e-3


SELECTION_BACKWARD_CASES = [  # (lengths, H_q, H_k, D, D_v, select_block, count, dtype)
    ([2048 + 77, 0, 1, 1531], 16, 2, 128, 128, 64, 16, torch.bfloat16),
    ([2503], 64, 4, 128, 128, 64, 16, torch.bfloat16),
    ([333, 1, 0, 1000], 16, 4, 64, 64, 64, 8, torch.float16),  # 128-row query tiles, 32 positions each
    ([1500, 77], 4, 2, 128, 64, 128, 6, torch.bfloat16),
    ([700, 5, 190], 2, 1, 128, 128, 192, 5, torch.bfloat16),
    ([999, 64], 8, 1, 96, 96, 64, 7, torch.bfloat16),
    ([1, 1300], 16, 4, 64, 64, 128, 9, torch.bfloat16),
    ([640, 211], 32, 2, 64, 128, 64, 4, torch.float16),
]


@pytest.mark.skipif(not _HOPPER, reason="the selection kernel needs an SM90 GPU")
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", range(len(SELECTION_BACKWARD_CASES)))
def test_the_selection_backward_kernel_against_the_reference(case, deterministic):
    """The selection backward (each K/V tile of a sequence walks the query tiles that chose its
    blocks) on random lists, against the fp64 reference's gradients with the same out and LSE
    (and a gradient on the LSE in every other case); the gradients and the fp32 dQ accumulator
    come from memory just filled with NaN, so an element the kernels did not write shows.
    ``deterministic``: a second call gives the same bits."""
    from fmha.backends import SELECTION_BACKWARD, runner_for, unsupported_reasons
    from fmha.nsa.selection_visits import SelectionProblem
    from fmha.problem import KernelOptions
    from gpu_cases import _poisoned_dq_accumulator

    lens, hq, hk, d, dv, lsel, n, dt = SELECTION_BACKWARD_CASES[case]
    q, k, v, sel, cu = _selection_inputs(lens, hq, hk, d, dv, lsel, n, dt, seed=100 + case)
    scale = d ** -0.5
    dedup = _without_repeats(sel, n)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    want_o, want_lse = ref.selection_attention_reference(q64, k64, v64, dedup, cu, lsel, softmax_scale=scale)
    dout = torch.randn(want_o.shape, device="cuda").to(dt)
    dlse = None
    if case % 2:
        dlse = torch.randn(want_lse.shape, device="cuda").masked_fill(torch.isneginf(want_lse), 0)
    outputs, cotangents = (want_o, want_lse), (dout.double(), None if dlse is None else dlse.double())
    used = [i for i, c in enumerate(cotangents) if c is not None]
    want = torch.autograd.grad([outputs[i] for i in used], (q64, k64, v64), [cotangents[i] for i in used])
    problem = SelectionProblem.of(q, k, v, lsel)
    options = KernelOptions(deterministic=deterministic)
    chosen, reasons = unsupported_reasons(problem, options, kind=SELECTION_BACKWARD)
    assert chosen is not None, reasons
    runner = runner_for(SELECTION_BACKWARD, chosen, problem, options)
    assert runner.cfg.deterministic == deterministic
    out, lse = want_o.detach().to(dt), want_lse.detach().float()
    grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
    with _poisoned_dq_accumulator(torch):
        got = runner(problem, dout, q, k, v, out, lse, dlse, sel, cu, scale, grads=grads)
    assert all(a is b for a, b in zip(got, grads))
    torch.cuda.synchronize()
    for name, a, b in zip("dq dk dv".split(), got, want):
        assert not a.isnan().any(), name
        assert rel_l2(a, b) < 2e-2, (name, rel_l2(a, b))
    if deterministic:
        again = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        runner(problem, dout, q, k, v, out, lse, dlse, sel, cu, scale, grads=again)
        for name, a, b in zip("dq dk dv".split(), again, got):
            assert torch.equal(a, b), name
