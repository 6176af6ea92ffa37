"""Device calls shared by the harness and the workloads, written once against ``torch.accelerator``.

``torch.accelerator`` (torch >= 2.6) names the current accelerator whatever it is (CUDA, ROCm, XPU, MPS,
HPU, ...); its memory functions came later (``memory_allocated``, ``max_memory_allocated``,
``reset_peak_memory_stats``, ``empty_cache``: torch 2.9; ``get_memory_info``: torch 2.10). Each function
here uses the ``torch.accelerator`` call where this torch has it and otherwise the device's own module
(``torch.cuda``, ``torch.xpu``, ...), so a call never fails only because the torch is older than the one
the code was written against. On the CPU each is a no-op or answers from the host. The same holds for the
``torch.distributed`` calls a newer torch renamed (:data:`all_gather_single`, :data:`reduce_scatter_single`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Device types whose pinned (page-locked) host memory makes a host-to-device copy asynchronous; elsewhere a
# batch is copied as it is (MPS has unified memory, and pin_memory() is not supported on every backend).
PINNED_COPY_DEVICES = ("cuda", "xpu")

# The single-tensor all-gather and reduce-scatter: ``*_single`` where this torch names them so (the older
# ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` then warn, once per call site, that they are
# deprecated), else the older names. Same arguments: (output, input, [op,] group=None, async_op=False).
all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


def _call(name: str, device: torch.device, *args: Any) -> Any:
    """``torch.accelerator.<name>(*args)`` where this torch has it, else ``torch.<device type>.<name>``."""
    function = getattr(torch.accelerator, name, None)
    if function is None:
        module = getattr(torch, device.type, None)
        function = getattr(module, name, None)
    if function is None:
        raise RuntimeError(f"torch {torch.__version__} has neither torch.accelerator.{name} nor "
                           f"torch.{device.type}.{name}")
    return function(*args)


def synchronize(device: torch.device) -> None:
    """Wait for all work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def rng_state(device: torch.device) -> torch.Tensor | None:
    """The state of ``device``'s own random generator (``torch.cuda.get_rng_state()`` ...); None on the CPU (its
    generator is ``torch.random``'s) or where the device's module has none."""
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    get = getattr(module, "get_rng_state", None)
    return get() if get is not None else None


def set_rng_state(device: torch.device, state: torch.Tensor) -> None:
    """Put back a state :func:`rng_state` returned for ``device``."""
    getattr(torch, device.type).set_rng_state(state)


def reset_peak_memory_stats(device: torch.device) -> None:
    """Start the allocator's peak (``max_memory_allocated``) afresh; a no-op on the CPU."""
    if device.type != "cpu":
        _call("reset_peak_memory_stats", device, device)


def max_memory_allocated(device: torch.device) -> int:
    """The accelerator allocator's peak bytes held by tensors since the last reset (0 on the CPU)."""
    if device.type == "cpu":
        return 0
    return int(_call("max_memory_allocated", device, device))


def free_memory_bytes(device: torch.device) -> int:
    """What the accelerator can still give this process: the driver's free memory plus what the caching
    allocator holds but no tensor uses (the driver counts that as used)."""
    if hasattr(torch.accelerator, "get_memory_info"):
        free = int(torch.accelerator.get_memory_info(device)[0])
    else:
        free = int(_call("mem_get_info", device, device)[0])
    try:
        cached = int(_call("memory_reserved", device, device)) - int(_call("memory_allocated", device, device))
    except (RuntimeError, AttributeError):
        cached = 0
    return free + max(0, cached)


def empty_cache(device: torch.device) -> None:
    """Give the caching allocator's unused blocks back to the driver; a no-op on the CPU."""
    if device.type == "cpu":
        return
    try:
        _call("empty_cache", device)
    except RuntimeError:
        pass  # a backend without a caching allocator has nothing to give back


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` runs bfloat16 matrix products natively (not emulated in float32): CUDA from
    Ampere (sm80) on, ROCm's CDNA2 and later, XPU as it reports; the CPU and other accelerators as true
    (their kernels exist; speed is theirs to show)."""
    if device.type == "cuda":
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # a torch whose is_bf16_supported takes no argument
            return bool(torch.cuda.is_bf16_supported())
    if device.type == "xpu" and hasattr(torch, "xpu"):
        return bool(torch.xpu.is_bf16_supported())
    return True


def pins_host_memory(device: torch.device) -> bool:
    """Whether batches bound for ``device`` should be pinned on the host, so that their copy with
    ``non_blocking=True`` overlaps the device's work instead of stalling the step."""
    return device.type in PINNED_COPY_DEVICES


def pin(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in pinned host memory (copied once, on the thread that calls this)."""
    return tensor if tensor.is_pinned() else tensor.pin_memory()


__all__ = ["PINNED_COPY_DEVICES", "synchronize", "reset_peak_memory_stats", "max_memory_allocated",
           "free_memory_bytes", "empty_cache", "bf16_supported", "pins_host_memory", "pin"]
