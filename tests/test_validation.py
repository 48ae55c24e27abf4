"""One test per check in fmha.validation: each asserts the error type and the part of the message
that names the problem, so it fails if the check is removed (the call would then succeed or fail
elsewhere with another message)."""

import pytest
import torch

import fmha
from fmha.validation import device_mismatch_message, kernel_options, validate

B, S, H, D = 2, 16, 2, 32


def t(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape).to(dtype).to(device)


def dense(**over):
    args = dict(q=t(B, S, H, D), k=t(B, S + 3, H, D), v=t(B, S + 3, H, D))
    args.update(over)
    return args


def run(**over):
    kw = dense(**over)
    return fmha.attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), backend="reference", **kw)


LENS_Q, LENS_K = [3, 0, 5], [4, 1, 5]


def cu(lens, dtype=torch.int32):
    offs = [0]
    for n in lens:
        offs.append(offs[-1] + n)
    return torch.tensor(offs, dtype=dtype)


def run_varlen(**over):
    kw = dict(q=t(sum(LENS_Q), H, D), k=t(sum(LENS_K), H, D), v=t(sum(LENS_K), H, D),
              cu_seqlens_q=cu(LENS_Q), cu_seqlens_k=cu(LENS_K), max_seqlen_q=None,
              max_seqlen_k=None)
    kw.update(over)
    return fmha.attention_varlen(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("cu_seqlens_q"),
                                 kw.pop("cu_seqlens_k"), kw.pop("max_seqlen_q"),
                                 kw.pop("max_seqlen_k"), backend="reference", **kw)


def raises(exc, match, fn, **over):
    with pytest.raises(exc, match=match):
        fn(**over)


def test_valid_calls_pass():
    assert run().shape == (B, S, H, D)
    assert run_varlen().shape == (sum(LENS_Q), H, D)


# --- tensors, dtypes, devices -------------------------------------------------------------

@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(name):
    raises(TypeError, f"{name} must be a torch.Tensor, got list", run, **{name: [[1.0]]})


def test_unsupported_dtype():
    raises(TypeError, "unsupported input dtype int32", run,
           q=torch.zeros(B, S, H, D, dtype=torch.int32), k=torch.zeros(B, S, H, D, dtype=torch.int32),
           v=torch.zeros(B, S, H, D, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_wide_float_inputs_are_problems(dtype):
    """fp32/fp64 inputs are valid: the reference serves them (in fp64 for fp64)."""
    p = validate(t(B, S, H, D, dtype=dtype), t(B, S, H, D, dtype=dtype), t(B, S, H, D, dtype=dtype))
    assert p.dtype == dtype and p.out_dtype == dtype


@pytest.mark.parametrize("name", ["k", "v"])
def test_dtype_mismatch(name):
    raises(TypeError, f"dtype mismatch: q is float16 but {name} is bfloat16", run,
           **{name: t(B, S, H, D, dtype=torch.bfloat16)})


@pytest.mark.parametrize("name", ["k", "v"])
def test_device_mismatch(name):
    raises(ValueError, f"device mismatch: q is on cpu but {name} is on meta", run,
           **{name: torch.empty(B, S, H, D, dtype=torch.float16, device="meta")})


def test_cpu_cuda_mix_message():
    msg = device_mismatch_message("k", torch.device("cuda:0"), torch.device("cpu"))
    assert "CPU/CUDA mix" in msg and ".to('cpu')" in msg
    assert "CPU/CUDA mix" not in device_mismatch_message("k", torch.device("meta"),
                                                         torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cpu_cuda_mix():
    raises(ValueError, "CPU/CUDA mix", run, k=t(B, S, H, D, device="cuda"))


# --- shapes -------------------------------------------------------------------------------

def test_dense_rank():
    raises(ValueError, r"q must have 4 dims \(B, S, H, D\)", run, q=t(S, H, D))


def test_varlen_rank():
    raises(ValueError, r"k must have 3 dims \(T, H, D\)", run_varlen, k=t(1, sum(LENS_K), H, D))


def test_batch_mismatch():
    raises(ValueError, "batch mismatch", run, k=t(B + 1, S, H, D), v=t(B + 1, S, H, D))


def test_head_dim_mismatch_q_k():
    raises(ValueError, "head dim mismatch: q has D=32, k has D=64", run,
           k=t(B, S, H, 64), v=t(B, S, H, 64))


def test_head_dim_v_may_differ():
    p = validate(t(B, S, H, D), t(B, S + 3, H, D), t(B, S + 3, H, 64))
    assert (p.head_dim, p.head_dim_v) == (D, 64)


def test_head_dim_k_must_equal_q():
    raises(ValueError, "head dim mismatch: q has D=32, k has D=64", run, k=t(B, S + 3, H, 64))


def test_seqlen_k_mismatch():
    raises(ValueError, "S_k mismatch between k", run, v=t(B, S + 4, H, D))


def test_heads_k_mismatch():
    raises(ValueError, "H_k mismatch between k", run, v=t(B, S + 3, H + 1, D))


def test_gqa_divisibility():
    raises(ValueError, "H_q=3 is not a multiple of H_k=2", run, q=t(B, S, 3, D))


def test_any_head_dim():
    """Every head dim is a valid call (the reference serves what no kernel does); rows that no
    kernel could read (not whole 16-byte pieces) skip the layout checks."""
    for d in (48, 36, 7):
        p = validate(t(B, S, H, d), t(B, S, H, d), t(B, S, H, d))
        assert p.head_dim == d
    q = t(B, S, 36, H).transpose(2, 3)  # head dim not contiguous, rows of 72 bytes: the reference reads it
    assert validate(q, t(B, S, H, 36), t(B, S, H, 36)).head_dim == 36


# --- layout -------------------------------------------------------------------------------

def test_head_dim_not_contiguous():
    q = t(B, S, D, H).transpose(2, 3)
    raises(ValueError, r"q head dim is not contiguous.*call \.contiguous\(\)", run, q=q)


def test_rows_misaligned():
    k = t(B, S + 3, H, D + 1)[..., :D]  # rows of 33 halves = 66 bytes
    raises(ValueError, r"k rows are not 16-byte aligned.*call \.contiguous\(\)", run, k=k)


def test_rows_misaligned_in_a_size_one_dim():
    q = torch.empty(1, S, H, D, dtype=torch.float16).as_strided((1, S, H, D), (7, H * D, D, 1))
    raises(ValueError, r"q rows are not 16-byte aligned: stride\(0\) = 7", run,
           q=q.normal_(), k=t(1, S, H, D), v=t(1, S, H, D))


def test_data_pointer_misaligned():
    n = B * S * H * D
    q = t(n + 1)[1:].view(B, S, H, D)  # 2 bytes past an aligned allocation
    raises(ValueError, r"q data pointer is not 16-byte aligned.*call \.contiguous\(\)", run, q=q)


def test_bhsd_view_is_accepted():
    q = t(B, H, S, D).transpose(1, 2)
    assert run(q=q).shape == (B, S, H, D)


# --- varlen -------------------------------------------------------------------------------

def test_cu_seqlens_not_a_tensor():
    raises(TypeError, "cu_seqlens_q must be a torch.Tensor", run_varlen, cu_seqlens_q=[0, 3, 3, 8])


def test_cu_seqlens_dtype():
    raises(TypeError, "cu_seqlens_k must be int32, got int64", run_varlen,
           cu_seqlens_k=cu(LENS_K, torch.int64))


def test_cu_seqlens_device():
    raises(ValueError, "device mismatch: q is on cpu but cu_seqlens_q is on meta", run_varlen,
           cu_seqlens_q=torch.empty(4, dtype=torch.int32, device="meta"))


def test_cu_seqlens_not_1d():
    raises(ValueError, "cu_seqlens_q must be 1-D", run_varlen,
           cu_seqlens_q=cu(LENS_Q).view(2, 2))


def test_cu_seqlens_contiguous():
    strided = torch.tensor([0, -1, 3, -1, 3, -1, 8], dtype=torch.int32)[::2]
    raises(ValueError, r"cu_seqlens_q must be contiguous \(stride 2\)", run_varlen,
           cu_seqlens_q=strided)


def test_cu_seqlens_length_mismatch():
    raises(ValueError, "cu_seqlens_q has 4 entries but cu_seqlens_k has 5", run_varlen,
           cu_seqlens_k=cu(LENS_K + [0]))


def test_cu_seqlens_start():
    raises(ValueError, "cu_seqlens_q must start at 0, got 1", run_varlen,
           cu_seqlens_q=torch.tensor([1, 3, 3, 8], dtype=torch.int32))


def test_cu_seqlens_decreasing():
    raises(ValueError, r"cu_seqlens_k must be nondecreasing: cu_seqlens_k\[2\] = 2", run_varlen,
           cu_seqlens_k=torch.tensor([0, 4, 2, 10], dtype=torch.int32))


def test_cu_seqlens_last_is_total():
    raises(ValueError, r"cu_seqlens_q\[-1\] = 7 but the tensor has 8 rows", run_varlen,
           cu_seqlens_q=torch.tensor([0, 3, 3, 7], dtype=torch.int32))


def test_cu_seqlens_read_once_per_tensor_version(monkeypatch):
    """The host read (a GPU sync) is paid once per cu_seqlens tensor; an in-place change is
    read and checked again, so a bad edit is still caught before any launch."""
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or tolist(self))
    q, k = t(sum(LENS_Q), H, D), t(sum(LENS_K), H, D)

    def check(cq, ck):
        validate(q, k, k, varlen=True, cu_seqlens_q=cq, cu_seqlens_k=ck)

    cq, ck = cu(LENS_Q), cu(LENS_K)
    check(cq, ck)
    check(cq, ck)
    assert len(reads) == 2  # one per tensor, not per call
    check(cq.clone(), ck)
    assert len(reads) == 3  # a new tensor is read
    ck[2] = 2  # [0, 4, 2, 10]: no longer nondecreasing
    raises(ValueError, r"cu_seqlens_k must be nondecreasing: cu_seqlens_k\[2\] = 2", check, cq=cq, ck=ck)
    assert len(reads) == 4


@pytest.mark.parametrize("name,real", [("max_seqlen_q", 5), ("max_seqlen_k", 5)])
def test_max_seqlen_too_small(name, real):
    raises(ValueError, f"{name} = 4 is smaller than the longest sequence \\({real}\\)",
           run_varlen, **{name: 4})


def test_max_seqlen_type():
    raises(TypeError, "max_seqlen_q must be an int, got float", run_varlen, max_seqlen_q=5.0)


def test_cu_seqlens_with_dense_inputs():
    with pytest.raises(ValueError, match="cu_seqlens are for varlen inputs"):
        from fmha.validation import validate
        validate(t(B, S, H, D), t(B, S, H, D), t(B, S, H, D), cu_seqlens_q=cu([S, S]))


# --- masks --------------------------------------------------------------------------------

def test_compressed_causal_sk_larger_than_sq():
    raises(ValueError, r"compressed_causal needs 1 <= S_k <= S_q, got S_q=16, S_k=19", run,
           compressed_causal=True)


def test_compressed_causal_no_keys():
    raises(ValueError, r"compressed_causal needs 1 <= S_k <= S_q, got S_q=16, S_k=0", run,
           k=t(B, 0, H, D), v=t(B, 0, H, D), compressed_causal=True)


def test_compressed_causal_per_sequence():
    # sequence 1 has no queries and is exempt; sequence 0 has S_k = 4 > S_q = 3
    raises(ValueError, r"S_q=3, S_k=4 \(sequence 0\)", run_varlen, compressed_causal=True)
    lens_q, lens_k = [4, 0, 5], [4, 1, 5]
    o = run_varlen(q=t(sum(lens_q), H, D), cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                   compressed_causal=True)
    assert o.shape == (9, H, D)


def _problem(**over):
    kw = dense(**over)
    return validate(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_negative_window_is_a_band_offset():
    assert _problem(window_size=(-1, 0)).mask.window_left == -1
    run(window_size=(-1, 0))


def test_softcap_and_sinks():
    p = _problem(softcap=30.0, sinks=torch.zeros(H))
    assert p.softcap == 30.0 and p.has_sinks
    run(softcap=30.0, sinks=torch.zeros(H))
    raises(ValueError, "softcap must be >= 0", run, softcap=-1.0)
    raises(TypeError, "softcap must be a Python float", run, softcap=torch.tensor(1.0))
    raises(ValueError, r"sinks must have one logit per query head, shape \(2,\)", run, sinks=torch.zeros(3))
    raises(TypeError, "sinks must be float32, bfloat16, float16 or float64", run, sinks=torch.zeros(H, dtype=torch.int64))
    raises(TypeError, "sinks must be a torch.Tensor", run, sinks=[0.0, 0.0])


# --- outputs ------------------------------------------------------------------------------

def test_out_shape():
    raises(ValueError, r"out has shape \(2, 16, 2, 64\), expected \(2, 16, 2, 32\)", run,
           out=t(B, S, H, 64))


def test_out_dtype_of_out():
    raises(TypeError, "out has dtype bfloat16, expected float16", run,
           out=t(B, S, H, D, dtype=torch.bfloat16), out_dtype=torch.float16)


def test_out_device():
    raises(ValueError, "device mismatch: q is on cpu but out is on meta", run,
           out=torch.empty(B, S, H, D, dtype=torch.float16, device="meta"))


def test_out_layout():
    raises(ValueError, "out head dim is not contiguous", run, out=t(B, S, D, H).transpose(2, 3))


def test_lse_shape():
    raises(ValueError, r"lse has shape \(2, 16, 2\), expected \(2, 2, 16\)", run,
           lse=t(B, S, H, dtype=torch.float32))


def test_lse_dtype():
    raises(TypeError, "lse has dtype float16, expected float32", run,
           lse=t(B, H, S, dtype=torch.float16))


def test_lse_device():
    raises(ValueError, "device mismatch: q is on cpu but lse is on meta", run,
           lse=torch.empty(B, H, S, device="meta"))


def test_lse_contiguous():
    raises(ValueError, "lse must be contiguous", run,
           lse=t(B, S, H, dtype=torch.float32).transpose(1, 2))


def test_out_dtype_unsupported():
    raises(TypeError, "unsupported out_dtype float32 for float16 input", run,
           out_dtype=torch.float32)


def test_fp8_out_needs_fp8_input():
    raises(TypeError, "unsupported out_dtype float8_e4m3fn for float16 input", run,
           out_dtype=torch.float8_e4m3fn)
    f8 = torch.float8_e4m3fn
    o = run(q=t(B, S, H, D, dtype=f8), k=t(B, S, H, D, dtype=f8), v=t(B, S, H, D, dtype=f8),
            out_dtype=f8)
    assert o.dtype == f8


def test_out_dtype_not_a_dtype():
    raises(TypeError, "out_dtype must be a torch.dtype, got str", run, out_dtype="float16")


# --- scales and knobs ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["softmax_scale", "scale_q", "scale_k", "scale_v", "inv_scale_o"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_scale_not_finite(name, value):
    raises(ValueError, f"{name} must be finite", run, **{name: value})


@pytest.mark.parametrize("value", [torch.tensor(1.0), "1.0", True])
def test_scale_not_a_number(value):
    raises(TypeError, "scale_v must be a Python float", run, scale_v=value)


def test_backend_name():
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'kernel', 'reference'"):
        fmha.attention(t(B, S, H, D), t(B, S, H, D), t(B, S, H, D), backend="gpu")


def test_kernel_options():
    with pytest.raises(TypeError, match="persistent must be True, False or None"):
        kernel_options(persistent=1)
    with pytest.raises(ValueError, match="tile_mn must be a pair"):
        kernel_options(tile_mn=128)
    with pytest.raises(ValueError, match="tile_mn tile_n must be a positive int"):
        kernel_options(tile_mn=(128, 0))
    assert kernel_options(True, (128, 64)).tile_n == 64
