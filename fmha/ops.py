"""fmha as torch custom ops: what makes ``fmha.attention`` differentiable and traceable.

``fmha::attention_forward`` (O and the LSE) and ``fmha::attention_backward`` (dq, dk, dv) are
registered with ``torch.library``, each with a fake (meta) implementation that only describes
its outputs, and the backward is the forward's autograd formula. So autograd records the call,
the LSE is saved rather than recomputed, ``torch.compile(fullgraph=True)`` traces a model that
calls fmha (the ops stay opaque nodes of the graph), and CUDA-graph capture sees plain launches.
Eager calls with autograd run the same forward and backward through a plain
``torch.autograd.Function`` (``_EagerAttention``), without the ops' dispatch cost; calls that
need no autograd go straight to ``dispatch.forward``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import register_flop_formula

from . import dispatch
from .options import OP_FIELDS, OP_SCHEMA, from_op_args, op_args
from .problem import default_out_dtype, accumulate_dtype
from .validation import kernel_options, lse_shape, out_shape

#: the forward op's arguments after q, k, v and sinks; the options' part follows ``fmha.options``
_CALL_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "varlen", "max_seqlen_q", "max_seqlen_k")
_KERNEL_ARGS = ("out_dtype", "backend", "persistent", "tile_mn", "deterministic")
_FORWARD_ARGS = _CALL_ARGS + tuple(name for name, _ in OP_FIELDS) + _KERNEL_ARGS
_NUM_OPTIONS = len(OP_FIELDS)
_MODS_SCHEMA = "Tensor[] aux, Tensor? block_states, int[]? block_geometry"
_FORWARD_SCHEMA = (f"(Tensor q, Tensor k, Tensor v, Tensor? sinks, {_MODS_SCHEMA}, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
                   f"bool varlen, int? max_seqlen_q, int? max_seqlen_k, {OP_SCHEMA}, ScalarType? out_dtype, "
                   "str backend, bool? persistent, int[]? tile_mn, bool deterministic) -> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? dlse, Tensor? sinks, "
                    f"{_MODS_SCHEMA}, "
                    "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int? max_seqlen_q, int? max_seqlen_k, "
                    f"{OP_SCHEMA}, bool deterministic, str backend) -> (Tensor, Tensor, Tensor, Tensor)")


def _split_forward_args(args):
    """(cu_q, cu_k, varlen, max_q, max_k), the options, (out_dtype, backend, persistent, tile_mn,
    deterministic) of the forward op's arguments after q, k, v and sinks."""
    call, rest = args[:len(_CALL_ARGS)], args[len(_CALL_ARGS):]
    return call, from_op_args(rest[:_NUM_OPTIONS]), rest[_NUM_OPTIONS:]


def mods_op_args(mods) -> tuple:
    """(aux, block_states, block_geometry): a call's ``CallMods`` as the ops' schema holds it (the
    functions travel in the options' part)."""
    if mods is None:
        return [], None, None
    bm = mods.block_mask
    return (list(mods.aux), None if bm is None else bm.states,
            None if bm is None else list(bm.block_size + bm.seq_lengths))


def _call_mods(options, aux, block_states, block_geometry):
    if options.score_mod is None and options.mask_mod is None and block_states is None:
        return None
    from .block_mask import BlockMask
    from .mods import CallMods

    bm = None if block_states is None else BlockMask.of_states(block_states, block_geometry)
    return CallMods(options.score_mod, options.mask_mod, tuple(aux), bm)


def _forward_impl(q, k, v, sinks, aux, block_states, block_geometry, *args):
    (cu_seqlens_q, cu_seqlens_k, varlen, max_seqlen_q, max_seqlen_k), options, kernel = _split_forward_args(args)
    out_dtype, backend, persistent, tile_mn, _ = kernel
    return dispatch.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, options=options, sinks=sinks, varlen=varlen,
                            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, return_lse=True, out=None,
                            lse=None, out_dtype=out_dtype, backend=backend, persistent=persistent,
                            tile_mn=None if tile_mn is None else tuple(tile_mn),
                            mods=_call_mods(options, aux, block_states, block_geometry))


def _forward_fake(q, k, v, sinks, aux, block_states, block_geometry, *args):
    out_dtype = args[len(_CALL_ARGS) + _NUM_OPTIONS]
    varlen = args[_CALL_ARGS.index("varlen")]
    out = q.new_empty(out_shape(q, v.shape[-1]), dtype=out_dtype or default_out_dtype(q.dtype))
    return out, q.new_empty(lse_shape(q, varlen), dtype=accumulate_dtype(q.dtype))


_forward_op = torch.library.custom_op("fmha::attention_forward", _forward_impl, mutates_args=(),
                                      schema=_FORWARD_SCHEMA)
_forward_op.register_fake(_forward_fake)


def _backward_impl(dout, q, k, v, out, lse, dlse, sinks, aux, block_states, block_geometry, cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args):
    """(dq, dk, dv, dsinks); dsinks is an empty tensor without sinks (an op returns tensors only)."""
    options, (deterministic, backend) = from_op_args(args[:_NUM_OPTIONS]), args[_NUM_OPTIONS:]
    grads = dispatch.backward(
        dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options=options,
        dlse=dlse, sinks=sinks, deterministic=deterministic, backend=backend,
        mods=_call_mods(options, aux, block_states, block_geometry))
    return grads if sinks is not None else grads + (q.new_empty(0, dtype=torch.float32),)


def _backward_fake(dout, q, k, v, out, lse, dlse, sinks, *args):
    dsinks = torch.empty_like(sinks) if sinks is not None else q.new_empty(0, dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


_backward_op = torch.library.custom_op("fmha::attention_backward", _backward_impl, mutates_args=(),
                                       schema=_BACKWARD_SCHEMA)
_backward_op.register_fake(_backward_fake)


#: inputs before the forward's ``_FORWARD_ARGS``: q, k, v, sinks, aux, block_states, block_geometry
_LEADING = 7


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # an unused LSE's gradient stays None: no zero tensor to read
    q, k, v, sinks, aux, block_states, block_geometry = inputs[:_LEADING]
    ctx.args = dict(zip(_FORWARD_ARGS, inputs[_LEADING:]))
    ctx.option_values = tuple(inputs[_LEADING + len(_CALL_ARGS):_LEADING + len(_CALL_ARGS) + _NUM_OPTIONS])
    ctx.block_geometry = block_geometry
    ctx.num_aux = len(aux)
    ctx.aux_needs_grad = [a.requires_grad for a in aux]
    out, lse = output
    ctx.save_for_backward(q, k, v, sinks, out, lse, ctx.args["cu_seqlens_q"], ctx.args["cu_seqlens_k"], block_states,
                          *aux)


def _backward(ctx, grad_out, grad_lse, backward=None):
    q, k, v, sinks, out, lse, cu_q, cu_k, block_states, *aux = ctx.saved_tensors
    a = ctx.args
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv, dsinks = (backward or torch.ops.fmha.attention_backward)(
        grad_out.contiguous(), q, k, v, out, lse, grad_lse, sinks, list(aux), block_states, ctx.block_geometry,
        cu_q, cu_k, a["max_seqlen_q"], a["max_seqlen_k"], *ctx.option_values, a["deterministic"], a["backend"])
    # the op's Tensor[] input takes a list of gradients; the autograd function's list argument None
    aux_grads = None if backward is not None else [None] * ctx.num_aux
    if any(ctx.aux_needs_grad):  # only the op path gets here: attention_forward routes such calls to it
        from .reference import aux_gradients

        # autograd through the mod, here at autograd's level (an op's body runs below it)
        options = from_op_args(ctx.option_values)
        aux_grads = aux_gradients(
            grad_out, q, k, v, out, lse, cu_q, cu_k, mods=_call_mods(options, aux, block_states, ctx.block_geometry),
            needs=ctx.aux_needs_grad, mask=options.mask, softmax_scale=options.softmax_scale, scale_q=options.scale_q,
            scale_k=options.scale_k, scale_v=options.scale_v, inv_scale_o=options.inv_scale_o, dlse=grad_lse)
    return (dq, dk, dv, dsinks if sinks is not None else None, aux_grads) + (None,) * (_LEADING - 5 + len(_FORWARD_ARGS))


_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The custom ops' forward and backward as a plain autograd function, for calls torch.compile
    is not tracing: torch.library's dispatch of the two ops cost about 1 ms of host time per
    training step, more than the kernels of a small step (docs/performance.md)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, aux, block_states, block_geometry, *args):
        out, lse = _forward_impl(q, k, v, sinks, aux, block_states, block_geometry, *args)
        _setup_context(ctx, (q, k, v, sinks, aux, block_states, block_geometry) + args, (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        grads = _backward(ctx, grad_out, grad_lse, backward=_backward_impl)
        if torch.is_grad_enabled():  # create_graph=True: differentiating them again raises
            inputs = [t for t in ctx.saved_tensors if t is not None and t.requires_grad]
            grads = tuple(g if g is None else _NotDifferentiableAgain.apply(g, *inputs) for g in grads)
        return grads


class _NotDifferentiableAgain(torch.autograd.Function):
    """A gradient of fmha's under ``create_graph=True``: it depends on the inputs, so that a second
    backward through it reaches this function and raises, as the custom op (which has no autograd
    formula for its backward) does, instead of treating the gradient as a constant."""

    @staticmethod
    def forward(ctx, grad, *inputs):
        return grad.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fmha.attention has no double backward: its gradients are not differentiable")


def _forward_flops(q_shape, k_shape, v_shape, sinks_shape, aux_shapes, block_states_shape, block_geometry,
                   cu_q_shape, cu_k_shape, varlen, max_seqlen_q, max_seqlen_k, *args, **kwargs) -> int:
    """The forward's matmul FLOPs as PyTorch counts SDPA's (the whole score matrix, masks not
    discounted): 2 * H_q * rows * keys * (D + D_v); a packed batch counts each query row against
    ``max_seqlen_k`` keys, or without it against every key row (an upper bound: the counter
    sees shapes, not the offsets)."""
    d, d_v, heads = q_shape[-1], v_shape[-1], q_shape[-2]
    if varlen:
        rows, keys = q_shape[0], max_seqlen_k if max_seqlen_k is not None else k_shape[0]
        return 2 * heads * rows * keys * (d + d_v)
    return 2 * q_shape[0] * heads * q_shape[1] * k_shape[1] * (d + d_v)


def _backward_flops(dout_shape, q_shape, k_shape, v_shape, out_shape_, lse_shape_, dlse_shape, sinks_shape,
                    aux_shapes, block_states_shape, block_geometry, cu_q_shape, cu_k_shape, max_seqlen_q, max_seqlen_k,
                    *args, **kwargs) -> int:
    """Twice the forward's, as PyTorch counts SDPA's backward (dQ, dK, dV and dP)."""
    return 2 * _forward_flops(q_shape, k_shape, v_shape, sinks_shape, aux_shapes, block_states_shape, block_geometry,
                              cu_q_shape, cu_k_shape, cu_q_shape is not None, max_seqlen_q, max_seqlen_k)


register_flop_formula(torch.ops.fmha.attention_forward)(_forward_flops)
register_flop_formula(torch.ops.fmha.attention_backward)(_backward_flops)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def plain_eager_call(q, k, v, sinks) -> bool:
    """Whether the call may take ``_EagerAttention``: plain tensors with no torch.compile tracing
    and no Python dispatch mode (meta and fake tensors, FlopCounterMode...), which need the ops'
    fake implementations."""
    return (not torch.compiler.is_compiling()
            and all(type(t) in _PLAIN_TENSORS for t in (q, k, v) + (() if sinks is None else (sinks,)))
            and q.device.type != "meta" and _get_current_dispatch_mode() is None)


def attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, options, sinks=None, varlen, max_seqlen_q,
                      max_seqlen_k, out_dtype=None, backend="auto", persistent=None, tile_mn=None,
                      deterministic=False, mods=None) -> Tuple[Tensor, Tensor]:
    """(O, LSE) through the custom op, with autograd: the public API's differentiable path.
    ``options`` (``fmha.options.AttentionOptions``) are checked already; the other scalars are
    checked here (plain Python, so torch.compile traces it) for the same errors validation gives;
    the tensors are checked when the op runs."""
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype must be a torch.dtype, got {type(out_dtype).__name__}")
    kernel_options(persistent, tile_mn)
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
    # aux tensors that need gradients: the op, whose Tensor[] input autograd follows (the plain
    # autograd function's list argument it does not)
    aux_grads = mods is not None and any(a.requires_grad for a in mods.aux)
    if aux_grads and torch.compiler.is_compiling():
        raise NotImplementedError("aux tensors that require grad are differentiated eagerly only: run this call "
                                  "outside torch.compile (a function decorated with @torch.compiler.disable), or "
                                  "pass the aux tensors detached")
    eager = plain_eager_call(q, k, v, sinks) and not aux_grads
    forward = _EagerAttention.apply if eager else torch.ops.fmha.attention_forward
    return forward(
        q, k, v, sinks, *mods_op_args(mods), cu_seqlens_q, cu_seqlens_k, varlen, max_seqlen_q, max_seqlen_k, *op_args(options),
        out_dtype, backend, persistent, None if tile_mn is None else list(tile_mn), deterministic)
