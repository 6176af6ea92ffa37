"""The check before any run: what a generated spec may make a replay do, in three parts.

A spec is untrusted input: generated benchmarks exist to be shared (captured at one organisation,
obfuscated, replayed on a vendor's machine), and anyone can edit the JSON. Replaying one must not be
able to touch anything but the tensors the replay itself creates. So, before anything runs,
:func:`check_spec` checks:

1. **its fields** (:mod:`.fields`): every field the replay reads has the type and bounds it must
   have, each argument fits its schema type, host gaps are finite and bounded;
2. **its ops** (:mod:`.policy`, the one place the policy is written): only ops that compute on
   tensors replay; a spec that calls another is refused naming the op, unless the user opts in for
   a spec they trust (``workload.trust_spec=true``, logged loudly);
3. **its memory** (:mod:`.memory`): the memory the replay's tensors need — every storage sized
   from its widest view, live from its first to its last use — must fit the device, else the spec
   is refused with both figures.

Every problem is a :class:`~workloads.trace_bundle.TraceError` naming the file, the op and the
field. The replay's generated code is built only from integers, Python literals of JSON scalars
and values it holds itself (see :mod:`.codegen`), so nothing of a spec is ever executed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workloads.trace_bundle import TraceError
from workloads.trace_replay.fields import SpecFields
from workloads.trace_replay.memory import estimate_peak_bytes
from workloads.trace_replay.policy import ALLOWED_NAMESPACES, refused_ops
from workloads.trace_replay.sparse import refuse_unmade_sparse


@dataclass
class SpecCheck:
    """What :func:`check_spec` found in a spec that may replay."""

    peak_bytes: list[int]  # per rank: the estimated peak memory of the replay's tensors
    trusted_ops: dict[str, str]  # ops the policy refuses that ``trust`` let through: name → why


def check_spec(spec: dict[str, Any], path: str | Path, *, trust: bool = False,
               memory_limit_bytes: int | None = None, rank: int | None = None) -> SpecCheck:
    """Check a loaded spec before anything of it runs; raise TraceError naming what is wrong.

    ``trust``: let ops the policy refuses through (the user vouches for the spec); they are
    returned in ``trusted_ops`` for the caller to log. ``memory_limit_bytes``: refuse a spec whose
    tensors would not fit (checked for ``rank``, or every rank).
    """
    path = Path(path)
    SpecFields(path).spec(spec)
    for rank_spec in spec["ranks"]:
        refuse_unmade_sparse(rank_spec["ops"], path)
    refused = refused_ops(spec)
    if refused and not trust:
        listed = "; ".join(f"{name}: {why}" for name, why in sorted(refused.items()))
        raise TraceError(f"{path}: the spec calls ops a replay refuses: {listed}. A replay runs only ops that "
                         f"compute on its own tensors (namespaces {', '.join(sorted(ALLOWED_NAMESPACES))}; see "
                         f"workloads/trace_replay/policy.py); if you trust this spec and its source, replay it with "
                         f"workload.trust_spec=true")
    peaks = [estimate_peak_bytes(r) for r in spec["ranks"]]
    if memory_limit_bytes is not None:
        for r, peak in enumerate(peaks):
            if rank is not None and r != rank:
                continue
            if peak > memory_limit_bytes:
                raise TraceError(f"{path}: rank {r}'s tensors need an estimated {peak / 2**20:,.0f} MiB at their peak "
                                 f"(every storage from its first to its last use), more than the "
                                 f"{memory_limit_bytes / 2**20:,.0f} MiB this device has available; replay it on a "
                                 f"larger device, or select part of it (`cobench trace generate --steps/--scope`)")
    return SpecCheck(peaks, refused if trust else {})
