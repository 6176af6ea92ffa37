"""What a workload sees of a fault-tolerant job: :class:`FaultTolerance` in ``RunContext.fault_tolerance``.

The harness (``harness/distribution/ft/``) runs R replica groups; this process belongs to group ``replica``. A
workload that supports it calls :meth:`FaultTolerance.attach` once its model and optimizer exist,
with functions that save and restore its whole training state (weights, optimizer, schedule, data
position). With torchft's ``manager`` that is the workload's parallelism choice across replicas:

- inside a group the model stays as the workload parallelised it (FSDP2 over the group's ranks, or
  one rank); across groups, gradients are averaged by the manager's fault-tolerant all-reduce:
  torchft's ``DistributedDataParallel`` for a one-rank group, an FSDP2 all-reduce hook otherwise
  (applied after FSDP2's reduce-scatter, on each rank's shard);
- the optimizer is wrapped so that ``zero_grad`` starts the next quorum and ``step`` applies the
  update only when every participant committed it (``manager.should_commit``);
- the state functions are registered with the manager: a restarted replica heals from a peer.

Without a manager (the same failure without torchft) nothing is wrapped: the harness only keeps the
state functions to checkpoint the job and restart it from the last checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class FaultTolerance:
    replica: int  # this process's replica group, 0 … replicas − 1
    replicas: int
    manager: Any = None  # torchft.Manager; None: a plain job restarted from checkpoints by the harness
    state_dict: Callable[[], dict[str, Any]] | None = field(default=None, repr=False)
    load_state_dict: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)
    # called once before the first quorum: the harness lets the groups of a fresh start join together (a
    # group ready seconds before the others would otherwise train alone and be steps ahead)
    before_first_quorum: Callable[[], None] | None = field(default=None, repr=False)

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: Callable[[], dict[str, Any]],
               load_state_dict: Callable[[dict[str, Any]], None]) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model and optimizer to train with; ``state_dict``/``load_state_dict``: the whole training
        state (a restarted replica heals from a peer's, a restarted job loads its checkpoint)."""
        self.state_dict, self.load_state_dict = state_dict, load_state_dict
        if self.manager is None:
            return model, optimizer
        from torch.distributed.fsdp import FSDPModule
        from torchft.optim import OptimizerWrapper

        manager = self.manager
        manager.register_state_dict_fn("workload", lambda peer: load_state_dict(_as_own(peer, state_dict())),
                                       state_dict)
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if sharded:
            for module in sharded:  # after FSDP2's reduce-scatter inside the group, on each rank's shard
                module.set_all_reduce_hook(lambda shard_grad: cross_replica_average(manager, shard_grad))
        else:
            model = _ReplicaDDP(manager, model)
        optimizer = OptimizerWrapper(manager, optimizer)
        if self.before_first_quorum is not None:
            self.before_first_quorum()
        optimizer.zero_grad(set_to_none=True)  # starts the first quorum (a new replica heals here)
        return model, optimizer


def _as_own(peer: Any, own: Any) -> Any:
    """A peer's training state shaped like ours: tensors that arrive as plain local shards where ours
    are DTensors (FSDP2) become DTensors on our mesh with our placements (same group rank, same shard)."""
    from torch.distributed.tensor import DTensor

    if isinstance(own, DTensor) and isinstance(peer, torch.Tensor) and not isinstance(peer, DTensor):
        return DTensor.from_local(peer.to(own.device), own.device_mesh, own.placements, run_check=False,
                                  shape=own.shape, stride=own.stride())
    if isinstance(own, dict) and isinstance(peer, dict):
        return {k: _as_own(v, own[k]) if k in own else v for k, v in peer.items()}
    if isinstance(own, list | tuple) and isinstance(peer, list | tuple) and len(own) == len(peer):
        return type(peer)(_as_own(p, o) for p, o in zip(peer, own, strict=True))
    return peer


def cross_replica_average(manager: Any, grad: torch.Tensor) -> None:
    """Average ``grad`` over the participating replica groups, in place, through the manager.

    Summed, then divided here: torchft 0.2.0's averaging runs as a callback on a future that is
    missing once a peer has died mid-step (its DDP hook then fails an assertion). A failed
    all-reduce is recorded by the manager, which then refuses to commit the step: the garbage it
    leaves in ``grad`` is never applied.
    """
    from torch.distributed import ReduceOp

    manager.allreduce(grad, reduce_op=ReduceOp.SUM).wait()
    grad.div_(max(1, manager.num_participants()))


def _replica_ddp_class() -> type:
    from torchft.ddp import DistributedDataParallel

    class ReplicaDDP(DistributedDataParallel):
        """torchft's DDP (dummy process group inside, fixed buckets) with :func:`cross_replica_average`."""

        @staticmethod
        def _comm_hook(manager, bucket):  # noqa: ANN001, ANN205 - DDP checks a hook's annotations: none
            cross_replica_average(manager, bucket.buffer())
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    return ReplicaDDP


# named like a class: it builds the class torchft makes importable
def _ReplicaDDP(manager: Any, model: nn.Module) -> nn.Module:
    return _replica_ddp_class()(manager, model)
