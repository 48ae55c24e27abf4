"""fmha.nsa's errors for bad input: each names the argument and says what to change."""

import pytest
import torch

import fmha
import fmha.nsa as nsa
from test_nsa import gates, inputs
from test_nsa_naive import cu_of, one_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.filterwarnings("ignore")

LENS = [5, 0, 12]
KW = dict(block=4, stride=2, select_block=4, select_count=2, window=3)


def call(q, k, v, gs=None, **kw):
    gs = gates(q.shape[0], q.shape[1]) if gs is None else gs
    return nsa.nsa_attention(q, k, v, *gs, **{**KW, **kw})


@pytest.fixture
def packed():
    q, k, v, cu = inputs(LENS, 4, 2, d=4)
    return q, k, v, cu


def test_dtypes_devices_and_shapes(packed):
    q, k, v, cu = packed
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        call(q.to(torch.int32), k, v, cu_seqlens=cu)
    with pytest.raises(TypeError, match="dtype mismatch: q is float64 but k is float32"):
        call(q, k.float(), v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="device mismatch"):
        call(q, k.to("meta"), v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="H_q=4 is not a multiple of H_k=3"):
        call(q, k.repeat(1, 2, 1)[:, :3], v.repeat(1, 2, 1)[:, :3], cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"q must have 4 dims \(B, S, H, D\)"):
        call(q, k, v)
    with pytest.raises(ValueError, match="head dim 4 but k has 5"):
        call(q, torch.zeros(17, 2, 5, dtype=q.dtype), v, cu_seqlens=cu)
    with pytest.raises(ValueError, match="share their token dims"):
        call(q, k[:-1], v[:-1], cu_seqlens=cu)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        call(q.tolist(), k, v, gs=gates(17, 4), cu_seqlens=cu)


def test_gates(packed):
    q, k, v, cu = packed
    g = gates(17, 4)
    with pytest.raises(ValueError, match=r"g_slc must have shape \(17, 4\) \(one gate per query token and head\)"):
        call(q, k, v, gs=(g[0], g[1][:, :2], g[2]), cu_seqlens=cu)
    with pytest.raises(TypeError, match="g_win must be a floating-point tensor"):
        call(q, k, v, gs=(g[0], g[1], g[2].long()), cu_seqlens=cu)


def test_offsets(packed):
    q, k, v, cu = packed
    with pytest.raises(TypeError, match=r"cu_seqlens must be int32, got int64; use .to\(torch.int32\)"):
        call(q, k, v, cu_seqlens=cu.long())
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        call(q, k, v, cu_seqlens=cu + 1)
    with pytest.raises(ValueError, match="must be nondecreasing"):
        call(q, k, v, cu_seqlens=torch.tensor([0, 9, 5, 17], dtype=torch.int32))
    with pytest.raises(ValueError, match="the last offset must equal the number of packed tokens"):
        call(q, k, v, cu_seqlens=torch.tensor([0, 5, 16], dtype=torch.int32))
    k_cmp, cu_cmp = nsa.mean_pool(k, cu, 4, 2)
    with pytest.raises(ValueError, match="compressed_cu_seqlens"):
        nsa.compression_attention(q, k_cmp, k_cmp, cu, cu_of([k_cmp.shape[0], 0, 0]), 4, 2)


def test_geometry(packed):
    q, k, v, cu = packed
    with pytest.raises(ValueError, match="stride \\(5\\) must not exceed block \\(4\\)"):
        call(q, k, v, cu_seqlens=cu, stride=5)
    for name in ("block", "select_block", "select_count", "window"):
        with pytest.raises(ValueError, match=f"{name} must be at least 1, got 0"):
            call(q, k, v, cu_seqlens=cu, **{name: 0})
    with pytest.raises(TypeError, match="block must be an int, got bool"):
        call(q, k, v, cu_seqlens=cu, block=True)
    with pytest.raises(ValueError, match="softmax_scale must be positive"):
        call(q, k, v, cu_seqlens=cu, softmax_scale=-1.0)


def test_selected(packed):
    q, k, v, cu = packed
    ok = torch.full((17, 2, 2), -1, dtype=torch.int32)
    call(q, k, v, cu_seqlens=cu, selected=ok)
    bad = ok.clone()
    bad[7, 1, 0] = 3  # token 7 is in the 12-token sequence: blocks 0..2
    with pytest.raises(ValueError, match=r"selected\[7, 1, 0\] \(packed token 7\) = 3 is out of range: .* 3 selection "
                                         r"blocks of select_block=4; use -1"):
        call(q, k, v, cu_seqlens=cu, selected=bad)
    bad[7, 1, 0] = -2
    with pytest.raises(ValueError, match="out of range"):
        call(q, k, v, cu_seqlens=cu, selected=bad)
    twice = ok.clone()
    twice[9, 0] = torch.tensor([1, 1])
    with pytest.raises(ValueError, match=r"lists a block twice: \[1, 1\]"):
        call(q, k, v, cu_seqlens=cu, selected=twice)
    with pytest.raises(TypeError, match="selected must be int32"):
        call(q, k, v, cu_seqlens=cu, selected=ok.float())
    with pytest.raises(ValueError, match=r"selected must have shape \(17, 2, 'n'\)"):
        call(q, k, v, cu_seqlens=cu, selected=ok[:, :1])


def test_compressed_kv_and_backend(packed):
    q, k, v, cu = packed
    k_cmp, _ = nsa.mean_pool(k, cu, 4, 2)
    with pytest.raises(ValueError, match="pass both k_cmp and v_cmp"):
        call(q, k, v, cu_seqlens=cu, k_cmp=k_cmp)
    with pytest.raises(ValueError, match=r"k_cmp must have shape \(6, 2, 4\): 6 compressed blocks of block=4, stride=2"):
        call(q, k, v, cu_seqlens=cu, k_cmp=k_cmp[:-1], v_cmp=k_cmp[:-1])
    with pytest.raises(fmha.UnsupportedError, match="CUDA"):  # every branch's kernel, the top-k's too
        call(q, k, v, cu_seqlens=cu, backend="kernel")
    with pytest.raises(fmha.UnsupportedError, match="CUDA"):  # with a list, the kernels say why they cannot
        nsa.selection_attention(q, k, v, torch.zeros(17, 2, 1, dtype=torch.int32), cu, 4, backend="kernel")
    with pytest.raises(ValueError, match="backend must be one of"):
        call(q, k, v, cu_seqlens=cu, backend="triton")
    _, lse = nsa.compression_attention(q, k_cmp, k_cmp, cu, nsa.compressed_cu_seqlens(cu, 4, 2), 4, 2)
    with pytest.raises(ValueError, match=r"lse_cmp must have shape \(4, 17\)"):
        nsa.select_blocks(q, k_cmp, lse.T, cu, nsa.compressed_cu_seqlens(cu, 4, 2), 4, 2, 4, 2)


def test_module_arguments():
    with pytest.raises(ValueError, match="pooling must be 'mean' or 'mlp'"):
        nsa.NativeSparseAttention(32, 4, 2, 8, pooling="max")
    with pytest.raises(ValueError, match="num_heads \\(4\\) must be a multiple of num_kv_heads \\(3\\)"):
        nsa.NativeSparseAttention(32, 4, 3, 8)
    with pytest.raises(ValueError, match="implementation must be"):
        nsa.NativeSparseAttention(32, 4, 2, 8, implementation="triton")
    with pytest.raises(ValueError, match="x must be \\(B, S, 32\\)"):
        nsa.NativeSparseAttention(32, 4, 2, 8)(torch.zeros(2, 5, 31))
    with pytest.raises(ValueError, match=r"x must have 4 dims \(B, S, H, D\) without cu_seqlens"):
        nsa.mean_pool(torch.zeros(5, 2, 4), None, 4, 2)
