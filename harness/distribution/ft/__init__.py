"""The failure scenario (``ft=torchft``): replica groups under torchft, one killed and restarted.

``cobench run workload=llama ft=torchft ft.replicas=2 ft.kill_at_step=20`` runs, in this order:

1. checks (bad input costs nothing; :mod:`harness.distribution.ft.checks`): a workload that supports fault tolerance,
   enough processes for ``replicas × procs_per_replica``, a kill step inside the run with room to recover,
   a free lighthouse port (``ft.lighthouse_port``; 0, the default: the one the lighthouse binds);
2. torchft's ``torchft_lighthouse`` and R replica groups, each its own ``torchrun`` (its own TCPStore
   and process group; FSDP2 inside a group of more than one rank) of :mod:`harness.distribution.ft.replica`. Each
   process builds the workload with a :class:`~workloads.fault_tolerance.FaultTolerance` holding torchft's
   ``Manager`` (a ``ProcessGroupGloo`` across replicas); the workload wraps its model and optimizer with it;
3. once group ``kill_replica`` has committed ``kill_at_step``, SIGKILL to its whole process group;
   ``restart_delay_s`` later it starts again and heals from a peer over HTTP while the survivors go on
   (:mod:`harness.distribution.ft.supervisor`);
4. with ``ft.baseline``, the same failure without torchft: one job of all the processes, checkpointed
   every ``checkpoint_interval`` steps, killed at the same step, restarted after the same delay from
   its last checkpoint;
5. one MLflow run with both sides' metrics (:func:`harness.distribution.ft.metrics.scenario_metrics`), the step logs
   as artifacts.

Every process appends one JSON line per step attempt to ``<run>/ft_<side>_replica<r>_rank<k>.jsonl``
(wall-clock start/end, the manager's committed step, whether it was committed, samples) and, at the
end, a hash of its training state, from which the launcher computes everything.
"""
