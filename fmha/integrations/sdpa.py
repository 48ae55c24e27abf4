"""fmha behind ``torch.nn.functional.scaled_dot_product_attention``: torch's flash-attention
implementation registry (``torch.nn.attention.register_flash_attention_impl``).

    import fmha.integrations.sdpa
    fmha.integrations.sdpa.register()                        # once; idempotent
    torch.nn.attention.activate_flash_attention_impl("fmha")
    ...                                                      # SDPA calls that pick flash run fmha
    torch.nn.attention.restore_flash_attention_impl()        # back to torch's own kernels

Activation replaces the CUDA kernels of the aten ops behind torch's flash backend, as torch's own
FA3/FA4 registrations do: ``_scaled_dot_product_flash_attention`` and its backward (what SDPA
calls for dense (B, H, S, D) inputs), and ``_flash_attention_forward`` /
``_flash_attention_forward_no_dropout_inplace`` / ``_flash_attention_backward`` (what the dense
op calls inside torch, and what nested-tensor SDPA and ``torch.nn.attention.varlen`` call, with
``cu_seqlens``). Each call that fmha's kernels serve runs fmha; every other call (dropout, a debug
mask, ALiBi, a paged or ``seqused_k`` KV cache, head dims or GPUs without an fmha kernel) runs
the torch kernel that was registered before, so activation never makes a call fail that worked.

Semantics follow the replaced ops, which are FlashAttention-2's: ``is_causal`` and windows are
aligned to the bottom-right corner, a negative window side is unbounded. SDPA's own ``is_causal``
is top-left aligned, and torch only picks the flash backend for it when S_q == S_k, where the two
alignments agree; a direct call of the dense op with S_q != S_k and ``is_causal`` is left to torch.

A forward and its backward always run on the same implementation (fmha's LSE of a row that keeps
no key is -inf, FlashAttention-2's is +inf, so the two do not mix): the backward of a call fmha
served runs fmha, on its reference where no backward kernel applies.

torch prefers cuDNN over flash on H100/H200 (with cuDNN > 9.15); with ``prefer_flash=True``
(the default) activation moves flash first in SDPA's backend priority order, so that the calls
fmha can serve reach it, and restoring puts the previous order back: the order torch settles at
its first CUDA backend choice, which activation makes happen first (an order read before any
CUDA SDPA call is torch's unsettled default, not the one it goes on to use).

The ops' argument lists differ between torch versions (torch 2.11 has no
``_flash_attention_forward_no_dropout_inplace``, and no ``block_table`` / ``num_splits``): only
the ops this torch has are replaced (``replaced_ops``), each call is read by the names of this
torch's schema, and a call fmha does not serve goes to torch's kernel exactly as it came.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

import fmha

__all__ = ["IMPL_NAME", "register", "routed_calls", "replaced_ops", "missing_torch_support"]

#: the name fmha is registered under in torch's flash-attention impl registry
IMPL_NAME = "fmha"

#: the aten ops whose CUDA kernel activation replaces (those this torch has: ``replaced_ops``),
#: and the ``_Route`` method that replaces each
_OPS = {
    "_scaled_dot_product_flash_attention": "sdpa_forward",
    "_scaled_dot_product_flash_attention_backward": "sdpa_backward",
    "_flash_attention_forward": "flash_forward",
    "_flash_attention_forward_no_dropout_inplace": "flash_forward_into",  # not in torch 2.11
    "_flash_attention_backward": "flash_backward",
}

_BACKENDS = ("kernel", "auto")

# "<op>: fmha" / "<op>: torch" -> calls, since the process started (``routed_calls``)
_ROUTED: collections.Counter = collections.Counter()

_ALIGN_BYTES = 16  # fmha's kernels read 16-byte aligned rows (fmha.validation)
_MEMO_LIMIT = 1024


def missing_torch_support() -> Optional[str]:
    """Why this torch cannot take fmha as its flash implementation (None: it can)."""
    missing = [f"torch.nn.attention.{name}" for name in
               ("register_flash_attention_impl", "activate_flash_attention_impl", "restore_flash_attention_impl")
               if not hasattr(torch.nn.attention, name)]
    if not hasattr(torch.library, "get_kernel"):
        missing.append("torch.library.get_kernel")
    if not missing:
        return None
    return (f"torch {torch.__version__} lacks {', '.join(missing)}, which fmha's SDPA registration needs "
            "(verified with torch 2.11 and 2.13); upgrade torch, or call fmha.attention directly")


def _schema(op: str):
    """``op``'s schema in this torch, or None where this torch has no such op."""
    try:
        return torch._C._get_schema(f"aten::{op}", "")
    except RuntimeError:
        return None


def replaced_ops() -> tuple:
    """The aten ops whose CUDA kernel activation replaces in this torch (torch 2.11 has no
    ``_flash_attention_forward_no_dropout_inplace``)."""
    return tuple(op for op in _OPS if _schema(op) is not None)


@functools.lru_cache(maxsize=None)
def _parameters(op: str) -> tuple:
    """(name, has a default, default) of each argument of ``op``'s schema in this torch."""
    return tuple((a.name, a.has_default_value(), a.default_value if a.has_default_value() else None)
                 for a in _schema(op).arguments)


def _bind(op: str, args: tuple, kwargs: dict) -> Dict[str, object]:
    """The arguments of one call of ``op`` by name, as this torch's schema has them (the
    dispatcher leaves out trailing defaults), and None for any argument the handlers read that
    this torch's schema does not have (``block_table`` and ``num_splits`` in torch 2.11)."""
    bound = collections.defaultdict(lambda: None)
    for i, (name, has_default, default) in enumerate(_parameters(op)):
        if i < len(args):
            bound[name] = args[i]
        elif name in kwargs:
            bound[name] = kwargs[name]
        elif has_default:
            bound[name] = default
        else:
            raise TypeError(f"aten::{op}: missing argument {name!r}")
    return bound


def register(*, backend: str = "kernel", prefer_flash: bool = True) -> None:
    """Register fmha in torch's flash-attention impl registry under ``IMPL_NAME`` ("fmha");
    ``torch.nn.attention.activate_flash_attention_impl("fmha")`` then routes to it. Calling it
    again replaces the registration with the new arguments (an active one keeps its own until it
    is activated again).

    ``backend``: "kernel" (the default) runs fmha only where one of its GPU kernels applies and
    leaves everything else to torch; "auto" runs every routed call on fmha, on its PyTorch
    reference where no kernel applies (exact, slow: for checking, not for speed).
    ``prefer_flash``: move the flash backend first in SDPA's priority order while fmha is active
    (module docstring)."""
    why = missing_torch_support()
    if why is not None:
        raise RuntimeError(why)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, _BACKENDS))}, got {backend!r}")
    if not isinstance(prefer_flash, bool):
        raise TypeError(f"prefer_flash must be True or False, got {prefer_flash!r}")
    torch.nn.attention.register_flash_attention_impl(
        IMPL_NAME, register_fn=functools.partial(_activate, backend=backend, prefer_flash=prefer_flash))


def routed_calls() -> Dict[str, int]:
    """How many calls of each replaced op ran on fmha ("<op>: fmha") and on torch's own kernel
    ("<op>: torch") since the process started."""
    return dict(_ROUTED)


@dataclass
class _Activation:
    """What one activation changed; torch's registry calls ``remove`` when it restores."""

    library: Optional[torch.library.Library]
    previous_priority: Optional[list] = None
    our_priority: Optional[list] = None

    def remove(self) -> None:
        self.library = None  # the last reference: its kernels are deregistered, torch's own are back
        if self.previous_priority is not None:
            # a priority order the user set since activation is theirs to keep
            if torch._C._get_sdp_priority_order() == self.our_priority:
                torch._C._set_sdp_priority_order(self.previous_priority)
            self.previous_priority = None


def _activate(*, backend: str, prefer_flash: bool) -> _Activation:
    """torch's registry calls this from ``activate_flash_attention_impl("fmha")``."""
    ops = replaced_ops()
    route = _Route(backend, {op: _torch_kernel(op) for op in ops})  # before ours replace them
    library = torch.library.Library("aten", "IMPL", "CUDA")
    for op in ops:
        library.impl(op, getattr(route, _OPS[op]), "CUDA", with_keyset=True)
    activation = _Activation(library)
    if prefer_flash and torch.cuda.is_available():
        activation.previous_priority, activation.our_priority = _put_flash_first()
    return activation


def _torch_kernel(op: str):
    """The CUDA kernel torch runs for ``op`` now (None on a torch built without CUDA)."""
    try:
        return torch.library.get_kernel(f"aten::{op}", "CUDA")
    except RuntimeError:  # "no kernel for CUDA": a CPU-only build
        return None


def _put_flash_first():
    """Move flash first in SDPA's backend priority order; (previous order, new order)."""
    # torch settles its default order (cuDNN first on H100/H200) at the first CUDA SDPA backend
    # choice, which would overwrite ours later: have that choice made now.
    probe = torch.zeros(1, 1, 1, 16, dtype=torch.float16, device="cuda")
    torch._fused_sdp_choice(probe, probe, probe)
    previous = list(torch._C._get_sdp_priority_order())
    flash = int(torch.nn.attention.SDPBackend.FLASH_ATTENTION)
    ours = [flash] + [b for b in previous if b != flash]
    torch._C._set_sdp_priority_order(ours)
    return previous, list(torch._C._get_sdp_priority_order())


def _bshd(*tensors):
    """(B, H, S, D) -> (B, S, H, D) views (fmha's layout); None stays None."""
    return tuple(None if t is None else t.transpose(1, 2) for t in tensors)


def _kernel_readable(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` if fmha's kernels can read it as it is, else a contiguous copy (torch's flash kernels
    copy such inputs too; fmha itself refuses them so that its callers see the copy)."""
    if t is None:
        return None
    elem = t.element_size()
    if (t.shape[-1] * elem) % _ALIGN_BYTES:
        return t  # no kernel reads such rows; fmha's reference reads any strides
    aligned = ((t.stride(-1) == 1 or t.shape[-1] == 1)
               and all((s * elem) % _ALIGN_BYTES == 0 for s in t.stride()[:-1])
               and t.data_ptr() % _ALIGN_BYTES == 0)
    # clone, not .contiguous(): a size-1 dim may keep an unaligned stride through .contiguous()
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def _window_side(side) -> Optional[int]:
    """A FlashAttention-2 window side (None or negative: unbounded) as fmha's (None: unbounded)."""
    return None if side is None or side < 0 else int(side)


def _metadata(*tensors) -> tuple:
    return tuple(None if t is None else (t.dtype, t.device, tuple(t.shape), t.stride()) for t in tensors)


@dataclass
class _Route:
    """The replacement kernels of one activation: fmha where it serves a call, else torch's."""

    backend: str
    torch_kernels: Dict[str, object]
    # whether fmha served the forward of a call (keyed by its tensors' metadata and mask), which
    # its backward follows (module docstring)
    served: Dict[tuple, bool] = field(default_factory=dict)

    def _torch(self, op: str, keyset, *args, **kwargs):
        kernel = self.torch_kernels[op]
        if kernel is None:
            raise RuntimeError(f"fmha does not serve this aten::{op} call and this torch build has no CUDA kernel "
                               "of its own for it")
        _ROUTED[f"{op}: torch"] += 1
        return kernel.call_boxed(keyset, *args, **kwargs)

    def _remember(self, key: tuple, served: bool) -> None:
        if len(self.served) >= _MEMO_LIMIT:
            self.served.clear()
        self.served[key] = served

    def _forward(self, key: tuple, q, k, v, out, **mask) -> Optional[torch.Tensor]:
        """Run fmha's forward into ``out`` (BSHD views); its LSE, or None when fmha does not
        serve the call (remembered, so that the next such call and its backward skip fmha)."""
        if self.served.get(key) is False:
            return None
        q, k, v = (_kernel_readable(t) for t in (q, k, v))
        into = out if _kernel_readable(out) is out else None
        try:
            with torch.no_grad():  # below autograd already: torch's own formula drives the backward
                o, lse = fmha.attention_varlen(q, k, v, return_lse=True, out=into, backend=self.backend, **mask) \
                    if "cu_seqlens_q" in mask else \
                    fmha.attention(q, k, v, return_lse=True, out=into, backend=self.backend, **mask)
        except fmha.UnsupportedError:
            self._remember(key, False)
            return None
        self._remember(key, True)
        if into is None:
            out.copy_(o)
        return lse

    def _backward(self, key: tuple, sample_forward: Callable, dout, q, k, v, out, lse, **mask):
        """fmha's (dq, dk, dv) when fmha served the forward of this call, else None.
        ``sample_forward(q, k, v, out)``: the forward as a ``fmha.FusedAttention``, asked whether
        fmha served it when this activation did not see it run."""
        dout, q, k, v, out = (_kernel_readable(t) for t in (dout, q, k, v, out))
        served = self.served.get(key)
        if served is None:
            try:
                served = sample_forward(q, k, v, out).check_support()
            except fmha.UnsupportedError:
                served = False
            self._remember(key, served)
        if not served:
            return None
        deterministic = torch.are_deterministic_algorithms_enabled()
        try:
            return fmha.attention_backward(dout, q, k, v, out, lse.contiguous(), deterministic=deterministic,
                                           backend=self.backend, **mask)
        except fmha.UnsupportedError:
            # the forward ran fmha: so must its backward, on fmha's reference where no kernel applies
            return fmha.attention_backward(dout, q, k, v, out, lse.contiguous(), deterministic=deterministic,
                                           backend="auto", **mask)

    # Each replaced kernel takes the call as the dispatcher gives it (``keyset, *args, **kwargs``,
    # this torch's schema), reads it by name (``_bind``), and hands a call fmha does not serve to
    # torch's kernel exactly as it came: the ops' argument lists differ between torch versions.

    # -- the dense SDPA op: (B, H, S, D) tensors --------------------------------------------------

    def sdpa_forward(self, keyset, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention"
        a = _bind(op, args, kwargs)
        query, key, value, is_causal, scale = a["query"], a["key"], a["value"], a["is_causal"], a["scale"]
        if not self._sdpa_servable(query, key, value, a["dropout_p"], is_causal) or a["return_debug_mask"]:
            return self._torch(op, keyset, *args, **kwargs)
        out = torch.empty_like(query)  # the op's output has the query's strides (its meta function's)
        lse = self._forward(_sdpa_key(query, key, value, is_causal, scale), *_bshd(query, key, value, out),
                            causal=is_causal, softmax_scale=scale)
        if lse is None:
            return self._torch(op, keyset, *args, **kwargs)
        _ROUTED[f"{op}: fmha"] += 1
        return (out, lse, None, None, query.size(2), key.size(2), *_no_dropout_state(query))

    def sdpa_backward(self, keyset, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention_backward"
        a = _bind(op, args, kwargs)
        query, key, value, out = a["query"], a["key"], a["value"], a["out"]
        is_causal, scale = a["is_causal"], a["scale"]
        grads = None
        if self._sdpa_servable(query, key, value, a["dropout_p"], is_causal):
            q, k, v, o = _bshd(query, key, value, out)
            grads = self._backward(
                _sdpa_key(query, key, value, is_causal, scale),
                lambda *qkvo: fmha.FusedAttention(*qkvo, causal=is_causal, softmax_scale=scale, backend="kernel"),
                a["grad_out"].transpose(1, 2), q, k, v, o, a["logsumexp"], causal=is_causal, softmax_scale=scale)
        if grads is None:
            return self._torch(op, keyset, *args, **kwargs)
        _ROUTED[f"{op}: fmha"] += 1
        return _bshd(*grads)

    @staticmethod
    def _sdpa_servable(query, key, value, dropout_p, is_causal) -> bool:
        """What fmha could serve of the dense op at all (before asking for a kernel)."""
        # dropout: fmha has none. A causal mask with S_q != S_k: SDPA never sends it here (its
        # is_causal is top-left aligned, this op's bottom-right), so it stays torch's.
        return (dropout_p == 0.0 and not (is_causal and query.size(2) != key.size(2))
                and value.size(-1) == query.size(-1))

    # -- FlashAttention-2's own ops: (B, S, H, D) dense or (T, H, D) with cu_seqlens -------------

    def flash_forward(self, keyset, *args, **kwargs):
        op = "_flash_attention_forward"
        a = _bind(op, args, kwargs)
        lse = None
        if _flash_servable(a):
            out = torch.empty_like(a["query"])  # the op's output has the query's strides (its meta function's)
            lse = self._flash_forward(a, out)
        if lse is None:
            return self._torch(op, keyset, *args, **kwargs)
        _ROUTED[f"{op}: fmha"] += 1
        return (out, lse, *_no_dropout_state(a["query"]))

    def flash_forward_into(self, keyset, *args, **kwargs):
        op = "_flash_attention_forward_no_dropout_inplace"
        a = _bind(op, args, kwargs)
        lse = self._flash_forward(a, a["out"]) if _flash_servable(a) else None
        if lse is None:
            return self._torch(op, keyset, *args, **kwargs)
        _ROUTED[f"{op}: fmha"] += 1
        return lse

    def _flash_forward(self, a, out):
        mask = _flash_mask(a)
        key = _flash_key(a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], mask)
        return self._forward(key, a["query"], a["key"], a["value"], out, **mask)

    def flash_backward(self, keyset, *args, **kwargs):
        op = "_flash_attention_backward"
        a = _bind(op, args, kwargs)
        grads = None
        if _flash_servable(a):
            mask = _flash_mask(a)
            key_ = _flash_key(a["query"], a["key"], a["value"], a["cum_seq_q"], a["cum_seq_k"], mask)
            grads = self._backward(key_, lambda *qkvo: fmha.FusedAttention(*qkvo, backend="kernel", **mask),
                                   a["grad_out"], a["query"], a["key"], a["value"], a["out"], a["logsumexp"],
                                   **mask)
        if grads is None:
            return self._torch(op, keyset, *args, **kwargs)
        _ROUTED[f"{op}: fmha"] += 1
        return grads


def _sdpa_key(query, key, value, is_causal, scale) -> tuple:
    return ("sdpa",) + _metadata(query, key, value) + (is_causal, scale)


def _flash_key(query, key, value, cum_seq_q, cum_seq_k, mask) -> tuple:
    plain = tuple(sorted((k, v) for k, v in mask.items() if not isinstance(v, torch.Tensor)))
    return ("flash",) + _metadata(query, key, value, cum_seq_q, cum_seq_k) + plain


def _flash_servable(a) -> bool:
    """What fmha could serve of a call of FlashAttention-2's ops at all (before asking for a
    kernel); ``a``: its arguments by name (``_bind``; those the op lacks read None)."""
    return (a["dropout_p"] == 0.0 and not a["return_debug_mask"] and a["seqused_k"] is None
            and a["alibi_slopes"] is None and a["block_table"] is None
            and (a["cum_seq_q"] is None) == (a["cum_seq_k"] is None) and a["value"].size(-1) == a["query"].size(-1))


def _flash_mask(a) -> dict:
    """fmha's keywords for FlashAttention-2's mask: bottom-right aligned, negative sides unbounded."""
    mask = dict(causal=bool(a["is_causal"]),
                window_size=(_window_side(a["window_size_left"]), _window_side(a["window_size_right"])),
                mask_align="bottom_right", softmax_scale=a["scale"])
    if a["cum_seq_q"] is not None:
        mask.update(cu_seqlens_q=a["cum_seq_q"], cu_seqlens_k=a["cum_seq_k"], max_seqlen_q=int(a["max_q"]),
                    max_seqlen_k=int(a["max_k"]))
    return mask


def _no_dropout_state(query):
    """(rng_state, unused, debug_attn_mask) of a call without dropout, as torch's FA4 returns them."""
    return (torch.zeros(2, dtype=torch.uint64, device=query.device),
            torch.zeros((), dtype=torch.uint64, device=query.device),
            torch.empty(0, dtype=query.dtype, device=query.device))
