"""The quickest way into each captured op from Python: torch's own generated binding for it where that binding
calls exactly what the op does, else the dispatcher's boxed call (``OpOverload._op``).

A replay spends the program's host time between its ops less its own cost of calling each one
(:mod:`.host_cost`); where the program ran its ops closer together than the replay can call them (a loop of
small ops, a GRU cell's, the autograd engine's backward), the replay's step is as long as its own calls.
The boxed call converts every argument against the op's schema and runs the op's boxed kernel: on this
project's CPU it cost 0.5 µs more than ``torch.mm`` for an 8 × 8 ``aten::mm``, 0.9 µs more than
``torch.mul`` for a tensor times a number, 0.4 µs more than ``torch.t``. torch's generated bindings
(``torch.*``, ``torch._C._nn.*``, ``torch._C._linalg.*``, ``torch._C._special.*``, ``torch._C._fft.*``, the
tensor methods) parse their arguments in C++ and call the op unboxed.

A binding's name is not its op: ``torch.add`` chooses among ``aten::add``'s overloads by its arguments,
and some bindings are Python-side compositions. So a binding is taken only where, called with this op's
own arguments (tensors as meta tensors of their layouts: nothing runs, nothing is written), it reaches the
dispatcher with exactly the calls the op itself does (a :class:`TorchDispatchMode` sees both: the op, or
for an op implemented by others, the ops it is made of), under no grad as the replay runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# where torch keeps its generated bindings, in the order a name is looked up
_BINDINGS = (torch._C._VariableFunctions, torch._C._nn, torch._C._linalg, torch._C._special, torch._C._fft,
             torch._C.TensorBase)


class _Calls(TorchDispatchMode):
    """The ops a call reaches the dispatcher with (below autograd, above the kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_meta(item) for item in value)
    return value


def _dispatched(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any] | None:
    """The ops ``fn(*args, **kwargs)`` reaches the dispatcher with, on meta copies of the tensors; None where
    it cannot run so."""
    calls = _Calls()
    try:  # a tensor with no meta twin (sparse), no meta kernel, arguments the binding does not take: not chosen
        meta_args, meta_kwargs = _meta(list(args)), {key: _meta(value) for key, value in kwargs.items()}
        # a trial: what it warns of (a deprecated overload the arguments happen to fit) is not the program's
        with torch.no_grad(), calls, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(*meta_args, **meta_kwargs)
    except Exception:  # noqa: BLE001 - see above
        return None
    return calls.seen


def python_binding(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> Callable[..., Any] | None:
    """torch's generated binding that calls ``op`` (an ``aten`` :class:`torch._ops.OpOverload`) with these
    arguments exactly as ``op`` itself does, or None (another namespace, no such binding, or one that
    reaches other ops than the op's own)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != "aten":
        return None
    name = op._schema.name.split("::", 1)[1]
    candidates = [binding for module in _BINDINGS if callable(binding := getattr(module, name, None))]
    if not candidates:
        return None
    reference = _dispatched(op, args, kwargs)
    if not reference:
        return None
    return next((binding for binding in candidates if _dispatched(binding, args, kwargs) == reference), None)


def _kind(value: Any) -> Any:
    """What decides a binding's choice and its meta call: a tensor's dtype and rank, a list's items' kinds, a
    number's or other value's type."""
    if isinstance(value, torch.Tensor):
        return "tensor", value.dtype, value.dim()
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_kind(item) for item in value)
    return type(value).__name__


def cached_binding(op: Any, args: Sequence[Any], kwargs: dict[str, Any],
                   cache: dict[Any, Callable[..., Any] | None]) -> Callable[..., Any] | None:
    """:func:`python_binding`, looked for once per op and kinds of arguments (a step calls the same ops over
    and over)."""
    key = (op, tuple(_kind(a) for a in args), tuple((k, _kind(v)) for k, v in kwargs.items()))
    if key not in cache:
        cache[key] = python_binding(op, args, kwargs)
    return cache[key]
