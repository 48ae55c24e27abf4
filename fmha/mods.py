"""Programmable attention: ``score_mod`` and ``mask_mod`` callables (docs/semantics.md).

One Python function runs in two places: in the exact reference, on broadcast PyTorch index
tensors, and in a kernel, where the CuTe DSL traces it on one score's scalars and compiles it in.
So a mod uses Python's operators and the few functions here (``where``, ``tanh``, ``exp``, ``log``,
``abs``, ``minimum``, ``maximum``), which pick PyTorch, Python or the DSL by their arguments' type.

- ``score_mod(score, b, h, q_idx, kv_idx)`` returns the modified score; ``mask_mod(b, h, q_idx,
  kv_idx)`` whether key ``kv_idx`` is kept for query ``q_idx``. Either may take a last ``aux``
  argument: the call's ``aux`` tensors, a tuple. Tensors a mod captures (a closure variable or a
  module global, FlexAttention's style) are read the same way: the kernel gets them as arguments
  and the DSL traces a copy of the function bound to them.
- The backward needs ``d score_mod / d score``. It is derived by tracing the function once more
  on a dual number (``Dual``: value and derivative, every operator and function here carries
  both), so any mod written with them is differentiated exactly; a mod whose derivative comes out
  a Python constant (a bias, ALiBi) costs the backward nothing.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import types
from dataclasses import dataclass, field
from typing import Callable, Optional, Tuple

import torch

__all__ = ["where", "tanh", "exp", "log", "abs", "minimum", "maximum", "Dual", "ModFunction"]


def _device_ops():
    from fmha.kernels.common import mod_ops  # the DSL's versions, imported only where a kernel traces

    return mod_ops


def _kind(*xs):
    """'dual', 'torch', 'python' or 'device' for the arguments of a portable function."""
    if any(isinstance(x, Dual) for x in xs):
        return "dual"
    if any(isinstance(x, torch.Tensor) for x in xs):
        return "torch"
    if all(isinstance(x, (int, float, bool)) for x in xs):
        return "python"
    return "device"


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b``."""
    kind = _kind(cond, a, b)
    if kind == "dual":
        a, b = Dual.of(a), Dual.of(b)
        return Dual(where(cond, a.value, b.value), where(cond, a.grad, b.grad))
    if kind == "torch":
        return torch.where(torch.as_tensor(cond), a, b)
    if kind == "python":
        return a if cond else b
    return _device_ops().where(cond, a, b)


def tanh(x):
    if isinstance(x, Dual):
        t = tanh(x.value)
        return Dual(t, x.grad * (1.0 - t * t))
    kind = _kind(x)
    return torch.tanh(x) if kind == "torch" else math.tanh(x) if kind == "python" else _device_ops().tanh(x)


def exp(x):
    if isinstance(x, Dual):
        e = exp(x.value)
        return Dual(e, x.grad * e)
    kind = _kind(x)
    return torch.exp(x) if kind == "torch" else math.exp(x) if kind == "python" else _device_ops().exp(x)


def log(x):
    if isinstance(x, Dual):
        return Dual(log(x.value), x.grad / x.value)
    kind = _kind(x)
    return torch.log(x) if kind == "torch" else math.log(x) if kind == "python" else _device_ops().log(x)


def abs(x):  # noqa: A001 (the name users expect)
    if isinstance(x, Dual):
        return Dual(abs(x.value), x.grad * where(x.value < 0, -1.0, 1.0))
    kind = _kind(x)
    return torch.abs(x) if kind == "torch" else (x if x >= 0 else -x) if kind == "python" else _device_ops().abs(x)


def minimum(a, b):
    return where(_value(a) <= _value(b), a, b)


def maximum(a, b):
    return where(_value(a) >= _value(b), a, b)


def _value(x):
    return x.value if isinstance(x, Dual) else x


class Dual:
    """A score and its derivative with respect to the unmodified score (forward-mode
    differentiation by tracing): ``Dual(score, 1.0)`` through a mod gives the modified score and
    its slope. Comparisons compare values."""

    __slots__ = ("value", "grad")

    def __init__(self, value, grad):
        self.value, self.grad = value, grad

    @staticmethod
    def of(x) -> "Dual":
        return x if isinstance(x, Dual) else Dual(x, 0.0)

    def __add__(self, o):
        o = Dual.of(o)
        return Dual(self.value + o.value, _add(self.grad, o.grad))

    __radd__ = __add__

    def __sub__(self, o):
        o = Dual.of(o)
        return Dual(self.value - o.value, _add(self.grad, _neg(o.grad)))

    def __rsub__(self, o):
        return Dual.of(o) - self

    def __neg__(self):
        return Dual(-self.value, _neg(self.grad))

    def __mul__(self, o):
        o = Dual.of(o)
        return Dual(self.value * o.value, _add(_mul(self.grad, o.value), _mul(o.grad, self.value)))

    __rmul__ = __mul__

    def __truediv__(self, o):
        o = Dual.of(o)
        q = self.value / o.value
        if _is_zero(o.grad):  # a constant divisor (the common case): no product rule
            return Dual(q, 0.0 if _is_zero(self.grad) else self.grad / o.value)
        return Dual(q, (self.grad - q * o.grad) / o.value)

    def __rtruediv__(self, o):
        return Dual.of(o) / self

    def __lt__(self, o):
        return self.value < _value(o)

    def __le__(self, o):
        return self.value <= _value(o)

    def __gt__(self, o):
        return self.value > _value(o)

    def __ge__(self, o):
        return self.value >= _value(o)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_zero(x) -> bool:
    return _is_number(x) and x == 0


# Constant derivatives stay Python numbers, so that a mod affine in the score folds to a constant.
def _add(a, b):
    if _is_zero(a):
        return b
    if _is_zero(b):
        return a
    return a + b


def _neg(a):
    return -a if _is_number(a) else 0.0 - a if not _is_zero(a) else 0.0


def _mul(grad, x):
    if _is_zero(grad) or _is_zero(x):
        return 0.0
    if _is_number(grad) and grad == 1:
        return x
    return grad * x


# ---- a mod as fmha holds it

SCORE, MASK = "score_mod", "mask_mod"
_INDEX_ARGS = 4  # b, h, q_idx, kv_idx


def _captured(fn: Callable) -> Tuple[Tuple[str, object], ...]:
    """(where, name) of every tensor ``fn`` reads from its closure ('cell') or globals ('global')."""
    found = []
    code = fn.__code__
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, torch.Tensor):
            found.append(("cell", name))
    for name in code.co_names:
        if isinstance(fn.__globals__.get(name), torch.Tensor):
            found.append(("global", name))
    return tuple(found)


def _code_digest(code: types.CodeType, h) -> None:
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(c, h)
        else:
            h.update(repr(c).encode())


@dataclass(frozen=True, eq=False)
class ModFunction:
    """A user's ``score_mod`` or ``mask_mod``, checked: its role, whether it takes ``aux``, the
    tensors it captures. Equal (and hashed) as its function; its repr, which keys compiled
    kernels on disk, names the function's code and constants, so an edit recompiles."""

    fn: Callable
    role: str
    takes_aux: bool
    captured: Tuple[Tuple[str, str], ...] = field(default=())

    @staticmethod
    def check(fn, role: str) -> Optional["ModFunction"]:
        if fn is None:
            return None
        if not callable(fn) or not hasattr(fn, "__code__"):
            raise TypeError(f"{role} must be a Python function (def or lambda), got {type(fn).__name__}")
        try:
            params = [p for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        except (TypeError, ValueError):
            raise TypeError(f"{role}: cannot read the signature of {fn!r}") from None
        base = _INDEX_ARGS + (1 if role == SCORE else 0)
        names = "score, b, h, q_idx, kv_idx" if role == SCORE else "b, h, q_idx, kv_idx"
        if len(params) not in (base, base + 1):
            raise TypeError(f"{role} takes ({names}) or ({names}, aux); {fn.__qualname__} takes "
                            f"{len(params)} arguments")
        return ModFunction(fn, role, len(params) == base + 1, _captured(fn))

    def __eq__(self, other):
        return isinstance(other, ModFunction) and other.fn is self.fn and other.role == self.role

    def __hash__(self):
        return hash((id(self.fn), self.role))

    def __repr__(self):
        h = hashlib.sha256()
        _code_digest(self.fn.__code__, h)
        # values the trace bakes in: closure variables and the globals the code names
        fn = self.fn
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                h.update(f"{name}={_baked(cell.cell_contents)}".encode())
            except ValueError:
                pass
        for name in fn.__code__.co_names:
            if name in fn.__globals__:
                h.update(f"{name}={_baked(fn.__globals__[name])}".encode())
        return f"{self.role}({getattr(self.fn, '__qualname__', '?')}:{h.hexdigest()[:16]})"

    def captured_tensors(self) -> tuple:
        """The captured tensors' current values (a global may be rebound between calls)."""
        fn = self.fn
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        return tuple(cells[name].cell_contents if where == "cell" else fn.__globals__[name]
                     for where, name in self.captured)

    def bound(self, captured_values) -> Callable:
        """The function with its captured tensors replaced by ``captured_values`` (the kernel's
        views of them), for the DSL to trace."""
        if not self.captured:
            return self.fn
        fn = self.fn
        new = dict(zip(self.captured, captured_values))
        cells = tuple(types.CellType(new[("cell", name)]) if ("cell", name) in new else cell
                      for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()))
        globals_ = dict(fn.__globals__)
        globals_.update({name: value for (where, name), value in new.items() if where == "global"})
        return types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, cells or None)


def _baked(value) -> str:
    """How a value a mod reads enters its compiled kernel: a tensor as an argument (its type),
    anything else as its repr (an object whose repr holds an address just misses the disk cache)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype}, {value.dim()})"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    return repr(value)


def call_score_mod(mod: ModFunction, fn: Callable, score, b, h, q_idx, kv_idx, aux):
    return fn(score, b, h, q_idx, kv_idx, aux) if mod.takes_aux else fn(score, b, h, q_idx, kv_idx)


def call_mask_mod(mod: ModFunction, fn: Callable, b, h, q_idx, kv_idx, aux):
    return fn(b, h, q_idx, kv_idx, aux) if mod.takes_aux else fn(b, h, q_idx, kv_idx)


# ---- ids for the custom ops' schema, which holds no Python objects

_REGISTRY: dict = {}
_IDS: dict = {}


def register(mod: Optional[ModFunction]) -> Optional[int]:
    """An int that names ``mod`` in an op's arguments (the same for the same function)."""
    return None if mod is None else _register(mod.fn, mod.role)


@torch.compiler.assume_constant_result
def _register(fn: Callable, role: str) -> int:
    # Run, not traced, under torch.compile: the compiled graph's ops look the id up when they
    # run, so the entry must exist before the graph does (a traced write lands after it).
    key = (id(fn), role)
    if key not in _IDS:
        _IDS[key] = len(_REGISTRY)
        _REGISTRY[_IDS[key]] = ModFunction.check(fn, role)  # kept alive: the id must not be reused
    return _IDS[key]


def lookup(mod_id: Optional[int]) -> Optional[ModFunction]:
    return None if mod_id is None else _REGISTRY[mod_id]


# ---- one call's mods: the functions (from the options) and the tensors they read

@dataclass(frozen=True)
class ModsSignature:
    """What of a call's mods selects a compiled kernel: the functions, the element type, rank and
    unit innermost stride of every tensor the kernel reads for them (``CallMods.kernel_tensors``'
    order; a unit stride lets neighbouring positions' loads share one address), whether a block
    mask lists the tiles."""

    score_mod: Optional[ModFunction]
    mask_mod: Optional[ModFunction]
    tensors: Tuple[Tuple[torch.dtype, int, bool], ...]
    block_sparse: bool


@dataclass(frozen=True, eq=False)
class CallMods:
    """A call's ``score_mod``/``mask_mod`` (``ModFunction``), its ``aux`` tensors and block mask
    (``fmha.block_mask.BlockMask``, or None)."""

    score_mod: Optional[ModFunction]
    mask_mod: Optional[ModFunction]
    aux: tuple
    block_mask: object = None

    def kernel_tensors(self) -> tuple:
        """What a kernel reads: ``aux``, then each function's captured tensors."""
        captured = tuple(t for m in (self.score_mod, self.mask_mod) if m is not None for t in m.captured_tensors())
        return self.aux + captured

    def all_tensors(self) -> tuple:
        """Every tensor the mods bring (the kernel's, then the block mask's states): what a
        reused plan's inputs must match."""
        return self.kernel_tensors() + (() if self.block_mask is None else (self.block_mask.states,))

    def signature(self) -> ModsSignature:
        return ModsSignature(self.score_mod, self.mask_mod,
                             tuple((t.dtype, t.dim(), t.dim() > 0 and t.stride(-1) == 1) for t in self.kernel_tensors()),
                             self.block_mask is not None)


def bind_signature(signature: ModsSignature, views) -> Tuple[Optional[Callable], Optional[Callable], tuple]:
    """(score function, mask function, aux) of a kernel's views of the tensors ``signature``
    lists (``CallMods.kernel_tensors``' order: aux, then each function's captured tensors)."""
    views = tuple(views) if views is not None else ()
    captured = [m for m in (signature.score_mod, signature.mask_mod) if m is not None]
    n_aux = len(views) - sum(len(m.captured) for m in captured)
    aux, rest = views[:n_aux], views[n_aux:]
    fns = []
    for m in (signature.score_mod, signature.mask_mod):
        if m is None:
            fns.append(None)
            continue
        fns.append(m.bound(rest[:len(m.captured)]))
        rest = rest[len(m.captured):]
    return fns[0], fns[1], aux


def call_mods(options, aux=None, block_mask=None) -> Optional[CallMods]:
    """The ``CallMods`` of a call's options and ``aux``/``block_mask`` arguments, or None when it has
    none; a FlexAttention ``BlockMask`` is converted, and lends its ``mask_mod`` if the call has
    none. Errors say what to change."""
    from .block_mask import BlockMask

    if aux is None:
        aux = ()
    elif isinstance(aux, torch.Tensor):
        aux = (aux,)
    elif isinstance(aux, (tuple, list)):
        aux = tuple(aux)
    else:
        raise TypeError(f"aux must be a tensor or a tuple of tensors, got {type(aux).__name__}")
    for i, t in enumerate(aux):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"aux[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        if type(block_mask).__name__ == "BlockMask" and hasattr(block_mask, "kv_num_blocks"):
            block_mask = BlockMask.from_flex(block_mask)
        else:
            raise TypeError("block_mask must be an fmha.BlockMask (fmha.create_block_mask) or a FlexAttention "
                            f"BlockMask, got {type(block_mask).__name__}")
    score_mod, mask_mod = options.score_mod, options.mask_mod
    if mask_mod is None and block_mask is not None and block_mask.mask_mod is not None:
        mask_mod = block_mask.mask_mod
        if not aux:
            aux = block_mask.aux
    if score_mod is None and mask_mod is None and block_mask is None:
        if aux:
            raise ValueError("aux= is read by score_mod or mask_mod; the call has neither")
        return None
    if aux and not any(m is not None and m.takes_aux for m in (score_mod, mask_mod)):
        raise ValueError("aux= is given but neither score_mod nor mask_mod takes an aux argument")
    if torch.is_grad_enabled():
        for m in (score_mod, mask_mod):
            for (_, name), t in zip(m.captured if m is not None else (), m.captured_tensors() if m is not None else ()):
                if t.requires_grad:  # its gradient would be lost without a word
                    raise ValueError(f"{m.role} {m.fn.__qualname__} captures {name!r}, a tensor that requires grad: "
                                     "fmha differentiates aux= tensors only; pass it as aux (the mod's last "
                                     f"argument) to train it, or capture {name}.detach()")
    return CallMods(score_mod, mask_mod, aux, block_mask)
