"""Checks made before anything runs, turning a call's arguments into an ``AttentionProblem``.

Every failure names the argument and says what to change. ``TypeError`` is raised for a value of
the wrong kind (not a tensor, a dtype we do not take, a scale that is not a number), ``ValueError``
for a value of the right kind that is wrong (shapes, strides, sequence lengths, devices).

Layouts are never fixed silently: a tensor the kernels cannot read as it is (head dim not
contiguous, rows not 16-byte aligned) is an error that says to call ``.contiguous()``, so the user
sees the copy they are paying for.

Varlen checks read ``cu_seqlens`` on the host: a device-to-host copy, which waits for the GPU.
That is the price of catching bad offsets here instead of as out-of-bounds reads in a kernel. It
is paid once per ``cu_seqlens`` tensor, not once per call: the offsets read are kept with the
tensor's version counter, which every in-place torch operation on it bumps, so the layers of a
model that share one ``cu_seqlens`` (every attention layer of a batch does) wait once per batch,
and a changed tensor is read and checked again. Writes that torch does not count (through
``.data``, DLPack or a raw pointer) are not seen: after one, pass a new tensor.
"""

from __future__ import annotations

import math
import numbers
import weakref
from typing import List, Optional, Sequence, Tuple

import torch

from .masking import MaskKind, MaskSpec
from .mods import CallMods, call_mods
from .options import AttentionOptions, parse_cached
from .problem import INPUT_DTYPES, AttentionProblem, KernelOptions, default_out_dtype, accumulate_dtype, output_dtypes_for

__all__ = ["validate", "validate_backward", "kernel_options", "lse_shape", "out_shape"]

#: TMA (and vectorized loads) need 16-byte aligned row starts
ALIGN_BYTES = 16


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_index_tensor(name: str, t, dim: int, device: torch.device) -> None:
    """Offsets, lengths and block tables: int32, on q's device, ``dim``-D, unit stride last."""
    _require_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_dtype_name(t.dtype)}; use .to(torch.int32)")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}; move it with .to(q.device)")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dim (stride {tuple(t.stride())}); "
                         f"call .contiguous() on {name}")


def _check_dtypes(q, k, v) -> None:
    if q.dtype not in INPUT_DTYPES:
        allowed = ", ".join(_dtype_name(d) for d in INPUT_DTYPES)
        raise TypeError(
            f"unsupported input dtype {_dtype_name(q.dtype)}; q, k and v must be one of {allowed} "
            "(convert with .to(torch.bfloat16), for example)"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(
                f"dtype mismatch: q is {_dtype_name(q.dtype)} but {name} is "
                f"{_dtype_name(t.dtype)}; q, k and v must have the same dtype"
            )


def device_mismatch_message(name: str, dev: torch.device, q_dev: torch.device) -> str:
    msg = f"device mismatch: q is on {q_dev} but {name} is on {dev}; put all tensors on one device"
    if {dev.type, q_dev.type} == {"cpu", "cuda"}:
        msg += f" (CPU/CUDA mix: move {name} with .to({str(q_dev)!r}))"
    return msg


def _check_device(name: str, t: torch.Tensor, q_dev: torch.device) -> None:
    if t.device != q_dev:
        raise ValueError(device_mismatch_message(name, t.device, q_dev))


def _check_shapes(q, k, v, varlen: bool) -> None:
    rank = 3 if varlen else 4
    layout = "(T, H, D) with cu_seqlens" if varlen else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(
                f"{name} must have {rank} dims {layout}, got shape {tuple(t.shape)}"
                + ("" if varlen else "; for BHSD tensors pass x.transpose(1, 2)")
            )
    if not varlen and not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"batch mismatch: q, k, v have batch sizes {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[:-1] != v.shape[:-1]:
        what = "S_k" if k.shape[-3] != v.shape[-3] else "H_k"
        raise ValueError(
            f"{what} mismatch between k {tuple(k.shape)} and v {tuple(v.shape)}: "
            "k and v need the same sequence length and number of heads"
        )
    d = q.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"head dim mismatch: q has D={d}, k has D={k.shape[-1]}; q and k need the same head dim")
    for name, t in (("q/k", q), ("v", v)):
        if t.shape[-1] < 1:
            raise ValueError(f"{name} head dim must be at least 1, got {t.shape[-1]}")
    hq, hk = q.shape[-2], k.shape[-2]
    if hk == 0:
        raise ValueError(f"k has no heads (H_k=0, shape {tuple(k.shape)}); it needs at least one")
    if hq % hk != 0:
        raise ValueError(
            f"H_q={hq} is not a multiple of H_k={hk}: grouped-query attention needs "
            "H_q % H_k == 0"
        )


def kernel_readable_rows(t: torch.Tensor) -> bool:
    """Whether a kernel could read rows of ``t``'s head dim at all: whole 16-byte pieces. Rows that
    are not (head dims like 36 in bf16) only the reference serves, and it reads any strides."""
    return (t.shape[-1] * t.element_size()) % ALIGN_BYTES == 0


def _aligned_pointer(t: torch.Tensor) -> bool:
    return t.data_ptr() % ALIGN_BYTES == 0


def _aligned_layout(t: torch.Tensor) -> bool:
    if t.stride(-1) != 1 or not _aligned_pointer(t):
        return False
    per_row = max(1, ALIGN_BYTES // t.element_size())
    return all(s == 0 or s % per_row == 0 for s in t.stride()[:-1])


def kernel_layout(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` itself when its pointer and strides are 16-byte aligned with a contiguous last dim,
    else a contiguous copy (differentiable): what fmha's kernels read. FlashAttention copies
    such inputs where fmha refuses them, so its compatibility layer makes that copy, and so do
    host sides that feed a kernel internal tensors (the NSA top-k)."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return t
    if t.is_contiguous():
        # a contiguous view at an odd offset: contiguous() would return it unchanged
        return t if _aligned_pointer(t) else t.clone(memory_format=torch.contiguous_format)
    if not _aligned_pointer(t):
        return t.clone(memory_format=torch.contiguous_format)
    return t if _aligned_layout(t) else t.contiguous()


def _check_layout(name: str, t: torch.Tensor) -> None:
    if not kernel_readable_rows(t):
        return
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(
            f"{name} head dim is not contiguous (stride(-1) = {t.stride(-1)}, strides "
            f"{tuple(t.stride())}); call .contiguous() on {name}"
        )
    elem = t.element_size()
    for dim in range(t.dim() - 1):
        # Size-1 dims too: kernels are compiled assuming every stride is aligned.
        if (t.stride(dim) * elem) % ALIGN_BYTES:
            raise ValueError(
                f"{name} rows are not {ALIGN_BYTES}-byte aligned: stride({dim}) = "
                f"{t.stride(dim)} elements = {t.stride(dim) * elem} bytes; call .contiguous() "
                f"on {name}"
            )
    if t.data_ptr() % ALIGN_BYTES:
        raise ValueError(
            f"{name} data pointer is not {ALIGN_BYTES}-byte aligned (a view with an offset?); "
            f"call .contiguous() on {name}"
        )


# id(cu_seqlens) -> (weak reference, version, data pointer, offsets): what ``_read_offsets`` read.
_OFFSETS_READ: dict = {}


def offsets_read_record(cu: torch.Tensor) -> Optional[tuple]:
    """The record ``_read_offsets`` keeps of its current read of ``cu`` (a new object at every
    read), or None when ``cu`` was not read at its current version."""
    seen = _OFFSETS_READ.get(id(cu))
    try:
        current = seen is not None and seen[0]() is cu and seen[1] == cu._version and seen[2] == cu.data_ptr()
    except RuntimeError:  # an inference tensor: no version counter, never kept
        return None
    return seen if current else None


def _read_offsets(cu: torch.Tensor) -> List[int]:
    """``cu.tolist()``, reused while ``cu`` is the same tensor at the same version (module
    docstring). Inference tensors have no version counter: they are read every time."""
    seen = offsets_read_record(cu)
    if seen is not None:
        return seen[3]
    try:
        version = cu._version
    except RuntimeError:
        return cu.tolist()
    key = id(cu)
    offsets = cu.tolist()  # host sync, see module docstring

    def forget(ref, key=key):
        if _OFFSETS_READ.get(key, (None,))[0] is ref:
            del _OFFSETS_READ[key]

    _OFFSETS_READ[key] = (weakref.ref(cu, forget), version, cu.data_ptr(), offsets)
    return offsets


def _check_offsets_tensor(name: str, cu, q_dev: torch.device) -> None:
    """What can be checked of cu_seqlens without reading its values."""
    _require_tensor(name, cu)
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {_dtype_name(cu.dtype)}; use .to(torch.int32)")
    _check_device(name, cu, q_dev)
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{name} must be 1-D of length B + 1, got shape {tuple(cu.shape)}")
    if not cu.is_contiguous():
        raise ValueError(f"{name} must be contiguous (stride {cu.stride(0)}); call .contiguous()")


def _seqlens_from_cu(name: str, cu, total: int, q_dev: torch.device) -> List[int]:
    _check_offsets_tensor(name, cu, q_dev)
    offsets = _read_offsets(cu)
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    lens = [b - a for a, b in zip(offsets[:-1], offsets[1:])]
    if any(n < 0 for n in lens):
        at = next(i for i, n in enumerate(lens) if n < 0)
        raise ValueError(
            f"{name} must be nondecreasing: {name}[{at + 1}] = {offsets[at + 1]} < "
            f"{name}[{at}] = {offsets[at]}"
        )
    if offsets[-1] != total:
        raise ValueError(
            f"{name}[-1] = {offsets[-1]} but the tensor has {total} rows; the last offset must "
            "equal the total number of tokens"
        )
    return lens


def _resolve_max_seqlen(name: str, given, lens: Sequence[int]) -> int:
    real = max(lens, default=0)
    if given is None:
        return real
    if isinstance(given, bool) or not isinstance(given, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(given).__name__}")
    if given < real:
        raise ValueError(
            f"{name} = {given} is smaller than the longest sequence ({real}); pass at least {real}"
        )
    return int(given)


def _needs_lengths(mask: MaskSpec) -> bool:
    """Compressed causal without a geometry derives it from each pair of lengths: read on the host."""
    return mask.kind == MaskKind.COMPRESSED_CAUSAL and mask.compression is None


def _check_compressed_causal(lens_q: Sequence[int], lens_k: Sequence[int]) -> None:
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        if sq > 0 and (sk == 0 or sk > sq):
            raise ValueError(
                f"compressed_causal needs 1 <= S_k <= S_q, got S_q={sq}, S_k={sk} "
                f"(sequence {b}); the compression ratio S_q // S_k must be at least 1"
            )


#: dtypes of a sinks tensor
SINK_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_sinks(sinks, num_heads_q: int, device: torch.device) -> None:
    """``sinks``: None, or one logit per query head, (H_q,) on q's device."""
    if sinks is None:
        return
    _require_tensor("sinks", sinks)
    if sinks.dtype not in SINK_DTYPES:
        raise TypeError(f"sinks must be float32, bfloat16, float16 or float64, got {_dtype_name(sinks.dtype)}")
    _check_device("sinks", sinks, device)
    if tuple(sinks.shape) != (num_heads_q,):
        raise ValueError(f"sinks must have one logit per query head, shape ({num_heads_q},), got {tuple(sinks.shape)}")


def out_shape(q: torch.Tensor, head_dim_v: int) -> Tuple[int, ...]:
    return tuple(q.shape[:-1]) + (head_dim_v,)


def lse_shape(q: torch.Tensor, varlen: bool) -> Tuple[int, ...]:
    if varlen:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def _resolve_out_dtype(out_dtype, out, in_dtype: torch.dtype) -> torch.dtype:
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else default_out_dtype(in_dtype)
    if not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    allowed = output_dtypes_for(in_dtype)
    if out_dtype not in allowed:
        raise TypeError(
            f"unsupported out_dtype {_dtype_name(out_dtype)} for {_dtype_name(in_dtype)} input; "
            f"choose one of {', '.join(_dtype_name(d) for d in allowed)}"
        )
    return out_dtype


def _check_output(name, t, shape, dtype, q_dev, like: str = "") -> None:
    """``like``: what the expected shape and dtype come from, named in the errors."""
    _require_tensor(name, t)
    _check_device(name, t, q_dev)
    origin = f" ({like}'s)" if like else ""
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}{origin}")
    if t.dtype != dtype:
        raise TypeError(
            f"{name} has dtype {_dtype_name(t.dtype)}, expected {_dtype_name(dtype)}{origin}"
        )


#: element types a mod's tensors may have (what the kernels load as a scalar)
MOD_TENSOR_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8,
                     torch.uint8)


def check_mods(mods: Optional[CallMods], batch: int, num_heads_q: int, seqlen_q: int, seqlen_k: int, varlen: bool,
               device: torch.device) -> None:
    """A call's mod tensors (``aux`` and captured ones) and block mask, against the call."""
    if mods is None:
        return
    for m in (mods.score_mod, mods.mask_mod):
        if m is not None and m.takes_aux and not mods.aux:
            raise ValueError(f"{m.role} {m.fn.__qualname__} takes an aux argument: pass aux=(tensors...)")
    for i, t in enumerate(mods.kernel_tensors()):
        name = f"aux[{i}]" if i < len(mods.aux) else f"a tensor captured by {mods.score_mod or mods.mask_mod}"
        if t.dtype not in MOD_TENSOR_DTYPES:
            raise TypeError(f"{name} has dtype {_dtype_name(t.dtype)}; mods read "
                            + ", ".join(_dtype_name(d) for d in MOD_TENSOR_DTYPES) + " (bool: use .to(torch.uint8))")
        _check_device(name, t, device)
        if t.dim() == 0:
            raise ValueError(f"{name} is 0-dimensional; give it one dim (t.reshape(1))")
    bm = mods.block_mask
    if bm is None:
        return
    if varlen:
        raise ValueError("block_mask= is for dense batches; with attention_varlen, write the mask as mask_mod "
                         "(every tile then evaluates it), or pad the batch")
    b, h = bm.states.shape[:2]
    if b not in (1, batch) or h not in (1, num_heads_q):
        raise ValueError(f"block_mask has B={b}, H={h}; the call has B={batch}, H_q={num_heads_q} (or use 1 for "
                         "a mask shared by every batch entry or head)")
    if bm.seq_lengths != (seqlen_q, seqlen_k):
        raise ValueError(f"block_mask is for {bm.seq_lengths[0]} x {bm.seq_lengths[1]}; the call has S_q={seqlen_q}, "
                         f"S_k={seqlen_k}: build it with those lengths")
    _check_device("block_mask", bm.states, device)


def validate(
    q,
    k,
    v,
    *,
    varlen: bool = False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    options: Optional[AttentionOptions] = None,
    sinks=None,
    return_lse: bool = False,
    out=None,
    lse=None,
    out_dtype=None,
    mods: Optional[CallMods] = None,
    **public_options,
) -> AttentionProblem:
    """Check a call's arguments and describe it; raise TypeError/ValueError saying what to fix.

    The mask, score and scale options come as ``options`` (``fmha.options.parse``'s) or as the
    public keywords. ``lse`` given implies ``return_lse``. For varlen, ``max_seqlen_*`` may be
    None (then taken from cu_seqlens); cu_seqlens are read on the host. ``mods``: the call's
    ``fmha.mods.CallMods`` (made from the options when they have mods and it is not given).
    """
    if options is None:
        options = parse_cached(**public_options)
    elif public_options:
        raise TypeError(f"pass the options either as options= or as keywords, not both: {sorted(public_options)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _require_tensor(name, t)
    _check_dtypes(q, k, v)
    for name, t in (("k", k), ("v", v)):
        _check_device(name, t, q.device)
    _check_shapes(q, k, v, varlen)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_layout(name, t)

    lens_read = True
    if varlen:
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            _check_offsets_tensor(name, cu, q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q has {cu_seqlens_q.numel()} entries but cu_seqlens_k has "
                f"{cu_seqlens_k.numel()}; both must have B + 1"
            )
        # Given both max lengths, the offsets stay on the device (no sync): the kernels check
        # them there (fmha.device_errors). compressed_causal needs each pair of lengths here.
        lens_read = (max_seqlen_q is None or max_seqlen_k is None or _needs_lengths(options.mask)
                     or q.device.type != "cuda")
        if lens_read:
            lens_q = _seqlens_from_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device)
            lens_k = _seqlens_from_cu("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device)
            seqlen_q = _resolve_max_seqlen("max_seqlen_q", max_seqlen_q, lens_q)
            seqlen_k = _resolve_max_seqlen("max_seqlen_k", max_seqlen_k, lens_k)
        else:
            seqlen_q = _resolve_max_seqlen("max_seqlen_q", max_seqlen_q, ())
            seqlen_k = _resolve_max_seqlen("max_seqlen_k", max_seqlen_k, ())
            lens_q = lens_k = None
        batch = cu_seqlens_q.numel() - 1
    else:
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            raise ValueError("cu_seqlens are for varlen inputs; use fmha.attention_varlen")
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        lens_q, lens_k = [seqlen_q] * batch, [seqlen_k] * batch

    mask = options.mask
    if _needs_lengths(mask):
        _check_compressed_causal(lens_q, lens_k)
    softmax_scale = options.softmax_scale
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    check_sinks(sinks, q.shape[-2], q.device)
    if mods is None and (options.score_mod is not None or options.mask_mod is not None):
        mods = call_mods(options)
    check_mods(mods, batch, q.shape[-2], seqlen_q, seqlen_k, varlen, q.device)

    out_dtype = _resolve_out_dtype(out_dtype, out, q.dtype)
    if out is not None:
        _check_output("out", out, out_shape(q, v.shape[-1]), out_dtype, q.device)
        _check_layout("out", out)
    if lse is not None:
        _check_output("lse", lse, lse_shape(q, varlen), accumulate_dtype(q.dtype), q.device)
        if not lse.is_contiguous():
            raise ValueError("lse must be contiguous; allocate it with torch.empty(shape)")

    return AttentionProblem(
        dtype=q.dtype,
        out_dtype=out_dtype,
        head_dim=q.shape[-1],
        head_dim_v=v.shape[-1],
        num_heads_q=q.shape[-2],
        num_heads_k=k.shape[-2],
        mask=mask,
        varlen=varlen,
        return_lse=bool(return_lse) or lse is not None,
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        total_q=q.shape[0] if varlen else batch * seqlen_q,
        total_k=k.shape[0] if varlen else batch * seqlen_k,
        softmax_scale=softmax_scale,
        softcap=options.softcap,
        has_sinks=sinks is not None,
        device=q.device,
        scale_q=options.scale_q,
        scale_k=options.scale_k,
        scale_v=options.scale_v,
        inv_scale_o=options.inv_scale_o,
        seqlens_q=tuple(lens_q) if varlen and lens_read else None,
        seqlens_k=tuple(lens_k) if varlen and lens_read else None,
        mods=None if mods is None else mods.signature(),
    )


def validate_backward(dout, q, k, v, out, lse, *, dlse=None, dq=None, dk=None, dv=None, dsinks=None,
                      **forward_kwargs) -> AttentionProblem:
    """Check a backward call: q, k, v, ``out`` and ``lse`` as the forward took and returned them
    (``validate``'s checks, with ``out`` and ``lse`` required), ``dout`` (and ``dlse``) shaped
    like ``out`` (and ``lse``), and the optional ``dq``/``dk``/``dv`` like q/k/v."""
    for name, t in (("out", out), ("lse", lse)):
        if t is None:
            raise TypeError(f"{name} is required: pass the forward's {name} (return_lse=True gives the LSE)")
    problem = validate(q, k, v, out=out, lse=lse, **forward_kwargs)
    if problem.dtype == torch.float8_e4m3fn:
        raise TypeError("fp8 inputs have no backward: train in bfloat16 or float16 "
                        "(convert q, k, v with .to(torch.bfloat16))")
    _check_output("dout", dout, tuple(out.shape), out.dtype, q.device, like="out")
    _check_layout("dout", dout)
    if dlse is not None:
        _check_output("dlse", dlse, tuple(lse.shape), lse.dtype, q.device, like="lse")
    for name, grad, like, like_name in (("dq", dq, q, "q"), ("dk", dk, k, "k"), ("dv", dv, v, "v")):
        if grad is not None:
            _check_output(name, grad, tuple(like.shape), like.dtype, q.device, like=like_name)
            _check_layout(name, grad)  # the kernel writes dk and dv (and may write dq) in place
    sinks = forward_kwargs.get("sinks")
    if dsinks is not None:
        if sinks is None:
            raise ValueError("dsinks= is the gradient of sinks: pass sinks too")
        _check_output("dsinks", dsinks, tuple(sinks.shape), sinks.dtype, q.device, like="sinks")
    return problem


def kernel_options(persistent=None, tile_mn=None) -> KernelOptions:
    """Check the kernel knobs (None = the backend chooses)."""
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent must be True, False or None, got {persistent!r}")
    if tile_mn is None:
        return KernelOptions(persistent=persistent)
    try:
        tile_m, tile_n = tile_mn
    except (TypeError, ValueError):
        raise ValueError(f"tile_mn must be a pair (tile_m, tile_n), got {tile_mn!r}") from None
    for name, t in (("tile_m", tile_m), ("tile_n", tile_n)):
        if isinstance(t, bool) or not isinstance(t, int) or t <= 0:
            raise ValueError(f"tile_mn {name} must be a positive int, got {t!r}")
    return KernelOptions(persistent=persistent, tile_m=tile_m, tile_n=tile_n)
