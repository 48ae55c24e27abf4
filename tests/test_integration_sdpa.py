"""fmha as torch's flash-attention implementation (``fmha.integrations.sdpa``), on the CPU:
registration, activation and restore, and the replaced CUDA kernels called through the
dispatcher's own kernel handles with CPU tensors (``register(backend="auto")``: fmha's reference
serves them), against SDPA's math backend and an explicit FlashAttention-2-semantics reference.
That SDPA calls on a GPU reach these kernels is ``test_gpu_integrations.py``'s part."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fmha.integrations.sdpa as fmha_sdpa

pytestmark = pytest.mark.skipif(fmha_sdpa.missing_torch_support() is not None,
                                reason=str(fmha_sdpa.missing_torch_support()))

OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
       "_flash_attention_forward", "_flash_attention_forward_no_dropout_inplace", "_flash_attention_backward")
PRESENT = fmha_sdpa.replaced_ops()  # torch 2.11 has no _flash_attention_forward_no_dropout_inplace
CUDA = torch._C.DispatchKeySet("CUDA")


@pytest.fixture
def active():
    """fmha activated (every routed call on fmha, its reference on the CPU); restored after."""
    fmha_sdpa.register(backend="auto")
    torch.nn.attention.activate_flash_attention_impl(fmha_sdpa.IMPL_NAME)
    yield
    torch.nn.attention.restore_flash_attention_impl()
    fmha_sdpa.register()


def kernel(op):
    """The CUDA kernel the dispatcher runs for ``op`` now."""
    return torch.library.get_kernel(f"aten::{op}", "CUDA")


def cuda_kernel_is_fmhas(op) -> bool:
    cuda = [line for line in torch._C._dispatch_dump(f"aten::{op}").splitlines() if line.startswith("CUDA:")]
    return any("fmha/integrations/sdpa.py" in line for line in cuda)


def test_register_is_idempotent_and_lists_fmha():
    fmha_sdpa.register()
    fmha_sdpa.register()
    assert torch.nn.attention.list_flash_attention_impls().count("fmha") == 1


def test_activation_replaces_the_flash_ops_cuda_kernels_and_restore_puts_torchs_back():
    assert set(PRESENT) == {op for op in OPS if fmha_sdpa._schema(op) is not None} >= set(OPS) - {OPS[3]}
    fmha_sdpa.register()
    assert not any(cuda_kernel_is_fmhas(op) for op in PRESENT)
    torch.nn.attention.activate_flash_attention_impl("fmha")
    try:
        assert torch.nn.attention.current_flash_attention_impl() == "fmha"
        assert all(cuda_kernel_is_fmhas(op) for op in PRESENT)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    assert torch.nn.attention.current_flash_attention_impl() is None
    assert not any(cuda_kernel_is_fmhas(op) for op in PRESENT)


def test_register_refuses_what_it_cannot_do(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of 'kernel', 'auto'"):
        fmha_sdpa.register(backend="reference")
    monkeypatch.delattr(torch.library, "get_kernel")
    with pytest.raises(RuntimeError, match="lacks torch.library.get_kernel"):
        fmha_sdpa.register()


def bhsd(b, h, s, d, dtype, transposed, seed):
    """A (B, H, S, D) tensor: contiguous, or a (B, S, H, D) tensor's transpose (what a model's
    projections give)."""
    g = torch.Generator().manual_seed(seed)
    if transposed:
        return torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2)
    return torch.randn(b, h, s, d, generator=g).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("transposed", [False, True])
def test_sdpa_op_forward_and_backward_match_sdpa_math(active, dtype, tol, causal, transposed):
    q = bhsd(2, 4, 37, 32, dtype, transposed, 0)
    k, v = bhsd(2, 2, 37, 32, dtype, transposed, 1), bhsd(2, 2, 37, 32, dtype, transposed, 2)
    dout = bhsd(2, 4, 37, 32, dtype, False, 3)
    before = fmha_sdpa.routed_calls()
    out, lse, *rest = kernel(OPS[0]).call_boxed(CUDA, q, k, v, 0.0, causal, False, scale=0.2)
    grads = kernel(OPS[1]).call_boxed(CUDA, dout, q, k, v, out, lse, None, None, 37, 37, 0.0, causal,
                                      rest[4], rest[5], scale=0.2)
    after = fmha_sdpa.routed_calls()
    assert after[f"{OPS[0]}: fmha"] == before.get(f"{OPS[0]}: fmha", 0) + 1
    assert after[f"{OPS[1]}: fmha"] == before.get(f"{OPS[1]}: fmha", 0) + 1

    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        want = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.2, enable_gqa=True)
    want.backward(dout.float())
    assert out.dtype == dtype and out.stride() == torch.empty_like(q).stride()  # the op's meta strides
    assert lse.shape == (2, 4, 37) and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    for got, leaf in zip(grads, leaves):
        assert got.shape == leaf.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), leaf.grad, rtol=tol, atol=tol)
    assert rest[2:4] == [37, 37] and rest[4].dtype == torch.uint64  # max_q, max_k, rng state


def flash2_reference(q, k, v, causal, left, right, scale):
    """FlashAttention-2's attention on one sequence, (S, H, D): windows and causal aligned to the
    bottom-right corner, a negative side unbounded; GQA by head groups."""
    s_q, s_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    i = torch.arange(s_q)[:, None] + (s_k - s_q)
    j = torch.arange(s_k)[None, :]
    keep = torch.ones(s_q, s_k, dtype=torch.bool)
    if causal:
        right = 0
    if left is not None and left >= 0:
        keep &= j >= i - left
    if right is not None and right >= 0:
        keep &= j <= i + right
    p = torch.softmax(scores.masked_fill(~keep, -math.inf), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, vf)


@pytest.mark.parametrize("causal,left,right", [(True, None, None), (False, 3, 1), (True, 4, -1), (False, -1, 0)])
def test_flash_op_varlen_with_windows_matches_flash_attention_2_semantics(active, causal, left, right):
    # lengths q 5, 9, 1 and k 8, 9, 6: S_q <= S_k, so the masks are aligned to the last key
    cu_q = torch.tensor([0, 5, 14, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 17, 23], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(15, 4, 16, generator=g)
    k, v = torch.randn(23, 2, 16, generator=g), torch.randn(23, 2, 16, generator=g)
    dout = torch.randn(15, 4, 16, generator=g)
    out, lse, rng, unused, debug = kernel("_flash_attention_forward").call_boxed(
        CUDA, q, k, v, cu_q, cu_k, 9, 9, 0.0, causal, False, scale=0.3, window_size_left=left,
        window_size_right=right)
    assert lse.shape == (4, 15)  # varlen LSE: (H, T_q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.cat([flash2_reference(leaves[0][cu_q[b]:cu_q[b + 1]], leaves[1][cu_k[b]:cu_k[b + 1]],
                                       leaves[2][cu_k[b]:cu_k[b + 1]], causal, left, right, 0.3)
                      for b in range(3)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    want.backward(dout)
    grads = kernel("_flash_attention_backward").call_boxed(
        CUDA, dout, q, k, v, out, lse, cu_q, cu_k, 9, 9, 0.0, causal, rng, unused, scale=0.3,
        window_size_left=left, window_size_right=right)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5)

    if OPS[3] not in PRESENT:
        return
    into = torch.full_like(q, float("nan"))
    lse_into = kernel("_flash_attention_forward_no_dropout_inplace").call_boxed(
        CUDA, into, q, k, v, cu_q, cu_k, 9, 9, 0.0, causal, False, scale=0.3, window_size_left=left,
        window_size_right=right)
    torch.testing.assert_close(into, out, rtol=0, atol=0)
    torch.testing.assert_close(lse_into, lse, rtol=0, atol=0)


def test_flash_op_dense_causal_is_bottom_right_aligned(active):
    """The dense FlashAttention-2 op with S_q < S_k: row i sees keys up to i + S_k - S_q."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 7, 4, 16, generator=g), torch.randn(2, 7, 4, 16)
    out, lse, *_ = kernel("_flash_attention_forward").call_boxed(CUDA, q, k, v, None, None, 3, 7, 0.0, True, False)
    want = torch.stack([flash2_reference(q[b], k[b], v[b], True, None, None, 16 ** -0.5) for b in range(2)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert lse.shape == (2, 4, 3)


@pytest.mark.skipif(torch.version.cuda is not None or torch.version.hip is not None,
                    reason="a GPU build of torch has CUDA kernels to defer to (test_gpu_integrations.py)")
def test_calls_fmha_does_not_serve_are_left_to_torch():
    """Dropout, a debug mask, or (with backend='kernel') no fmha kernel: the call goes to the
    kernel torch had registered; this CPU-only build has none, which the error says."""
    q = torch.randn(1, 2, 8, 16)
    fmha_sdpa.register(backend="auto")
    torch.nn.attention.activate_flash_attention_impl("fmha")
    try:
        with pytest.raises(RuntimeError, match="fmha does not serve this aten::_scaled_dot_product_flash_attention"):
            kernel(OPS[0]).call_boxed(CUDA, q, q, q, 0.1, False, False)  # dropout
        with pytest.raises(RuntimeError, match="fmha does not serve this aten::_flash_attention_forward"):
            kernel("_flash_attention_forward").call_boxed(CUDA, q, q, q, None, None, 8, 8, 0.0, False, True)
    finally:
        torch.nn.attention.restore_flash_attention_impl()
    fmha_sdpa.register(backend="kernel")  # the default: fmha's kernels only; on the CPU there are none
    torch.nn.attention.activate_flash_attention_impl("fmha")
    try:
        with pytest.raises(RuntimeError, match="fmha does not serve"):
            kernel(OPS[0]).call_boxed(CUDA, q, q, q, 0.0, False, False)
    finally:
        torch.nn.attention.restore_flash_attention_impl()


def test_a_backward_runs_where_its_forward_ran():
    """A forward fmha did not serve has its backward on torch's kernel too (their LSEs of empty
    rows differ), and one fmha served stays on fmha."""
    route = fmha_sdpa._Route("auto", {op: None for op in PRESENT})
    q = torch.randn(1, 2, 8, 16)
    out = torch.zeros_like(q)
    lse = torch.zeros(1, 2, 8)
    key = fmha_sdpa._sdpa_key(q, q, q, False, None)
    route.served[key] = False
    with pytest.raises(RuntimeError, match="fmha does not serve this aten::_scaled_dot_product_flash_attention_backward"):
        route.sdpa_backward(CUDA, out, q, q, q, out, lse, None, None, 8, 8, 0.0, False, None, None)
    route.served[key] = True
    grads = route.sdpa_backward(CUDA, out, q, q, q, out, lse, None, None, 8, 8, 0.0, False, None, None)
    assert [g.shape for g in grads] == [q.shape] * 3


class RecordingKernel:
    """Stands in for torch's captured kernel: records what it was called with."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((args, kwargs))
        return "torch's result"


def schema_call(op, q, cu=None):
    """A call of ``op`` that fmha does not serve (dropout 0.1), with every argument of this
    torch's schema given: its positional arguments, and its keyword-only ones by name."""
    t = torch.zeros(2, dtype=torch.int32)
    values = dict(query=q, key=q, value=q, grad_out=q, out=q, logsumexp=torch.zeros(1, 2, 8), cum_seq_q=cu,
                  cum_seq_k=cu, max_q=8, max_k=8, dropout_p=0.1, is_causal=False, return_debug_mask=False,
                  philox_seed=t, philox_offset=t, rng_state=t, unused=t)
    args, kwargs = [], {}
    for argument in torch._C._get_schema(f"aten::{op}", "").arguments:
        if argument.kwarg_only:
            kwargs[argument.name] = values.get(argument.name)
        else:
            args.append(values[argument.name])
    return tuple(args), kwargs


@pytest.mark.parametrize("op", PRESENT)
def test_calls_fmha_does_not_serve_reach_torchs_kernel_with_this_torchs_arguments_untouched(op):
    """torch 2.11's ops take fewer arguments than 2.13's: whatever this torch's schema has goes to
    its kernel as it came, in full or with the trailing defaults left out."""
    recorder = RecordingKernel()
    route = fmha_sdpa._Route("auto", {o: recorder for o in PRESENT})
    q = torch.randn(1, 2, 8, 16)
    args, kwargs = schema_call(op, q)
    before = fmha_sdpa.routed_calls().get(f"{op}: torch", 0)
    assert getattr(route, fmha_sdpa._OPS[op])(CUDA, *args, **kwargs) == "torch's result"
    assert recorder.calls == [(args, kwargs)]
    assert fmha_sdpa.routed_calls()[f"{op}: torch"] == before + 1
    if op == OPS[0]:  # the dispatcher leaves out trailing defaults: dropout_p=0 and scale=None
        assert route.sdpa_forward(CUDA, q, q, q, 0.1) == "torch's result"
        assert recorder.calls[-1] == ((q, q, q, 0.1), {})


def test_restore_puts_back_the_priority_order_activation_changed_unless_the_user_changed_it():
    original = torch._C._get_sdp_priority_order()
    try:
        changed = [1, 3, 2, 0, 4]
        torch._C._set_sdp_priority_order(changed)
        fmha_sdpa._Activation(None, previous_priority=[3, 1, 2, 0, 4], our_priority=changed).remove()
        assert torch._C._get_sdp_priority_order() == [3, 1, 2, 0, 4]
        torch._C._set_sdp_priority_order([2, 1, 3, 0, 4])  # the user's, after activation
        fmha_sdpa._Activation(None, previous_priority=[3, 1, 2, 0, 4], our_priority=changed).remove()
        assert torch._C._get_sdp_priority_order() == [2, 1, 3, 0, 4]
    finally:
        torch._C._set_sdp_priority_order(original)
