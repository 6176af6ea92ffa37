"""Fused kernels one device has and another lacks, replayed through the replay device's own.

A program's attention runs as the fused kernel its device picked for ``scaled_dot_product_attention``: on a
CPU ``aten::_scaled_dot_product_flash_attention_for_cpu``, on CUDA the flash, memory-efficient or cuDNN kernel.
Each has a backward that reads what its own forward saved (a log-sum-exp in that kernel's layout, a random
seed). A spec captured on one device and replayed on another names kernels the other may have none of (the
CPU's flash kernel on a GPU, a GPU's on a CPU). Where the replay's device has no kernel for such an op, its
forward runs ``scaled_dot_product_attention``, which takes the kernel this device picks for those inputs
(in a training step's replay with autograd on, its graph kept); its backward runs that graph's backward.
The pair is then the device's own fused forward and backward, as the program would have run them here. The
op's other outputs (log-sum-exp, seeds, sequence offsets) are made in their captured shapes; only the
stand-in's backward could read them, and it reads the graph instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from workloads.trace_replay.ops import TensorInfo

SDPA_FORWARD = frozenset(f"aten::_scaled_dot_product_{kind}" for kind in (
    "flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"))
SDPA_BACKWARD = frozenset(f"{name}_backward" for name in SDPA_FORWARD)
PORTED = "scaled_dot_product_attention (this device's own kernel, forward and backward)"
# the dispatch key of a device's kernels; any other device type is an out-of-tree backend's
DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "hpu": "HPU", "mps": "MPS", "mtia": "MTIA",
                 "meta": "Meta"}
KEEP_GRAPHS = 256  # forward graphs awaiting their backward (a step's attention layers, and more)


def lacks_kernel(name: str, device: torch.device) -> bool:
    """Whether ``name`` (``aten::...``) is a fused attention kernel with no kernel for ``device`` here."""
    if name not in SDPA_FORWARD and name not in SDPA_BACKWARD:
        return False
    key = DISPATCH_KEYS.get(device.type, "PrivateUse1")
    return not torch._C._dispatch_has_kernel_for_dispatch_key(name, key)


def _binder(schema: str) -> Callable[[tuple, dict], dict[str, Any]]:
    """A call's positional and keyword arguments → {name: value} by ``schema``, defaults filled in."""
    arguments = torch._C.parse_schema(schema).arguments
    names = [a.name for a in arguments]
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}

    def bind(args: tuple, kwargs: dict) -> dict[str, Any]:
        return {**defaults, **dict(zip(names, args, strict=False)), **kwargs}

    return bind


class PortableAttention:
    """The stand-ins of one replay: forward graphs are kept, by their output's address, for their backward
    (in a training step's replay only: a forward-only program's attention keeps nothing, as the program's
    own did not)."""

    def __init__(self, device: torch.device, training: bool = True):
        self.device, self.training = device, training
        self.graphs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}

    def stand_in(self, name: str, schema: str, out_infos: list[TensorInfo | None]) -> Callable[..., Any]:
        """The callable that replays op ``name`` through this device's attention."""
        bind = _binder(schema)
        if name in SDPA_FORWARD:
            def forward(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
                out = self._forward(bind(args, kwargs))
                return (out.detach(), *self._others(out_infos[1:]))

            return forward

        def backward(*args: Any, **kwargs: Any) -> tuple[Any, ...]:
            call = bind(args, kwargs)
            kept = self.graphs.pop(call["out"].data_ptr(), None)
            if kept is None:  # its forward is not in this replay (a spec that starts between them): run it here
                self._forward(call, keep=True)
                kept = self.graphs.pop(next(reversed(self.graphs)))
            out, leaves = kept
            grad = call.get("grad_out", call.get("grad_out_"))
            grads = torch.autograd.grad(out, leaves, grad.to(out.dtype))
            return (*grads, *self._others(out_infos[len(grads):]))

        return backward

    def _forward(self, call: dict[str, Any], keep: bool | None = None) -> torch.Tensor:
        keep = self.training if keep is None else keep
        query, key, value = (call[n].detach().requires_grad_(keep) for n in ("query", "key", "value"))
        mask = call.get("attn_mask", call.get("attn_bias"))
        with torch.set_grad_enabled(keep):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask,
                                                 dropout_p=float(call.get("dropout_p") or 0.0),
                                                 is_causal=bool(call.get("is_causal")), scale=call.get("scale"),
                                                 enable_gqa=key.shape[-3] != query.shape[-3])
        if keep:
            if len(self.graphs) >= KEEP_GRAPHS:  # forwards whose backward never came (evaluation steps)
                self.graphs.pop(next(iter(self.graphs)))
            self.graphs[out.data_ptr()] = (out, (query, key, value))
        return out

    def _others(self, infos: list[TensorInfo | None]) -> list[Any]:
        """The op's other outputs, empty in their captured shapes (None where it returned no tensor)."""
        return [torch.empty(i.shape, dtype=i.dtype, device=self.device) if i is not None else None for i in infos]
