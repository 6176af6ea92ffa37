"""torch.distributed set-up from the ``torchrun`` environment, and gathering results to rank 0."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def env_dist_info() -> DistInfo:
    """What torchrun told this process (a single process when it did not)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=world_size,
    )


def default_backend(device: torch.device) -> str:
    return {"cuda": "nccl", "xpu": "xccl"}.get(device.type, "gloo")


def init_distributed(device: torch.device, backend: str = "auto", timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun set up; a no-op for a single process."""
    info = env_dist_info()
    if not info.enabled:
        return info
    chosen = default_backend(device) if backend == "auto" else backend
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": chosen, "timeout": timedelta(seconds=timeout_s)}
        if device.type != "cpu":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistInfo(info.rank, info.local_rank, info.world_size, chosen)


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def gather_to_all(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable, produced by our own code), in rank order."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (e.g. a validation error, so all ranks stop together)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
