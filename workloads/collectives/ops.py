"""The collectives, their buffers, their expected results and nccl-tests' bandwidth conventions.

Sizes follow nccl-tests: ``S`` (the ``bytes`` column) is the size of the whole operation as one rank
sees it, and its per-rank chunk is ``S / n`` where a collective splits it:

=================  =====================================  ==============
collective         S is                                   bus factor
=================  =====================================  ==============
all_reduce         the buffer reduced                      2 (n − 1) / n
all_gather         the gathered output (n chunks of S/n)   (n − 1) / n
reduce_scatter     the input reduced (n chunks of S/n)     (n − 1) / n
all_to_all         what one rank sends (n chunks of S/n)   (n − 1) / n
all_to_all_moe     what one rank sends on average          (n − 1) / n
broadcast          the buffer sent from the root           1
reduce             the buffer reduced onto the root        1
send_recv          what one rank sends (ring: r → r + 1)   1
=================  =====================================  ==============

``algbw = S / t`` and ``busbw = algbw × factor``: the bus factor turns the algorithm's bandwidth into
the bandwidth one link must carry with the optimal algorithm (a ring all-reduce moves
2 (n − 1) / n × S over each link), so busbw is comparable across collectives and rank counts and
can be held against the hardware's peak link bandwidth.

``all_to_all_moe``: variable splits shaped like MoE token routing. Each rank holds ``S / row_bytes``
tokens of ``moe_row_elems`` elements and sends each to the rank owning its expert, drawn from a
Zipf-skewed expert popularity (exponent ``moe_skew``; 0 = uniform) whose hot expert moves every
step. Every rank derives the same routing matrix from a shared seed, so no count exchange is timed.

Every buffer holds small integers that identify the sending rank and position, so the result of
each collective can be checked exactly (reductions of up to ~80 ranks stay exact in bfloat16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workloads.device import all_gather_single, reduce_scatter_single

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_moe", "broadcast",
               "reduce", "send_recv")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64, "int32": torch.int32}


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth (see the module docstring)."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all", "all_to_all_moe"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce", "send_recv"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")


def _pattern(rank: int, numel: int, offset: int = 0, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s values at positions ``offset … offset + numel``: small integers (1 … 5)."""
    index = torch.arange(offset, offset + numel, device=device, dtype=torch.int64)
    return ((index + 7 * rank) % 5 + 1).to(dtype)


def _reduced(world: int, numel: int, offset: int = 0, *, device: torch.device) -> torch.Tensor:
    """The sum over all ranks of :func:`_pattern`, in float64."""
    return sum(_pattern(r, numel, offset, dtype=torch.float64, device=device) for r in range(world))


def moe_routing(world: int, tokens_per_rank: int, skew: float, seed: int) -> torch.Tensor:
    """``counts[src, dst]``: tokens rank ``src`` sends to rank ``dst`` (each row sums to
    ``tokens_per_rank``); one expert per rank, popularity ∝ 1 / rank^skew, hot expert shuffled."""
    generator = torch.Generator().manual_seed(seed)
    popularity = 1.0 / torch.arange(1, world + 1, dtype=torch.float64) ** skew
    popularity = popularity[torch.randperm(world, generator=generator)]
    counts = torch.zeros(world, world, dtype=torch.int64)
    for src in range(world):
        choice = torch.multinomial(popularity, tokens_per_rank, replacement=True, generator=generator)
        counts[src] = torch.bincount(choice, minlength=world)
    return counts


@dataclass
class Buffers:
    """One size's tensors on one rank; ``run`` issues the collective once, ``check`` verifies it."""

    run: Callable[[], None]
    reset: Callable[[], None]  # restore inputs an in-place collective overwrote (not timed)
    check: Callable[[], None]  # raises AssertionError naming what is wrong


def _tolerance(dtype: torch.dtype) -> float:
    return 0.0 if dtype in (torch.float32, torch.float64, torch.int32) else 1e-2


def _expect(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, rank: int) -> None:
    got64 = got.to(torch.float64)
    bad = (got64 - want).abs() > _tolerance(dtype) * want.abs()
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0]) if bad.dim() else 0
        raise AssertionError(f"{name} on rank {rank}: {int(bad.sum())} of {bad.numel()} elements wrong "
                             f"(first at {first}: got {got64.flatten()[first].item()}, "
                             f"expected {want.flatten()[first].item()})")


def make_buffers(collective: str, size_bytes: int, dtype: torch.dtype, group: dist.ProcessGroup,
                 device: torch.device, *, root: int = 0, moe_row_elems: int = 64, moe_skew: float = 1.0,
                 seed: int = 0) -> tuple[Buffers, int]:
    """Tensors for one collective of ``size_bytes`` (rounded down to whole elements, a multiple of
    the world size where it splits); returns them and the bytes actually moved (``S``)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    item = torch.empty((), dtype=dtype).element_size()
    split = collective in ("all_gather", "reduce_scatter", "all_to_all")
    quantum = world if split else 1
    if collective == "all_to_all_moe":
        quantum = moe_row_elems
    numel = max(quantum, size_bytes // item // quantum * quantum)
    global_root = dist.get_global_rank(group, root)
    make = dict(dtype=dtype, device=device)

    if collective == "all_reduce":
        source, buf = _pattern(rank, numel, **make), torch.empty(numel, **make)
        want = _reduced(world, numel, device=device)
        return Buffers(lambda: dist.all_reduce(buf, group=group), lambda: buf.copy_(source),
                       lambda: _expect(collective, buf, want, dtype, rank)), numel * item
    if collective == "reduce":
        source, buf = _pattern(rank, numel, **make), torch.empty(numel, **make)
        want = _reduced(world, numel, device=device)
        return Buffers(lambda: dist.reduce(buf, dst=global_root, group=group), lambda: buf.copy_(source),
                       lambda: rank != root or _expect(collective, buf, want, dtype, rank)), numel * item
    if collective == "broadcast":
        source, buf = _pattern(root, numel, **make), torch.empty(numel, **make)
        want = source.to(torch.float64)
        return Buffers(lambda: dist.broadcast(buf, src=global_root, group=group),
                       lambda: buf.copy_(source) if rank == root else buf.zero_(),
                       lambda: _expect(collective, buf, want, dtype, rank)), numel * item
    chunk = numel // world
    if collective == "all_gather":
        mine, out = _pattern(rank, chunk, rank * chunk, **make), torch.empty(numel, **make)
        want = torch.cat([_pattern(r, chunk, r * chunk, dtype=torch.float64, device=device) for r in range(world)])
        return Buffers(lambda: all_gather_single(out, mine, group=group), out.zero_,
                       lambda: _expect(collective, out, want, dtype, rank)), numel * item
    if collective == "reduce_scatter":
        source, out = _pattern(rank, numel, **make), torch.empty(chunk, **make)
        want = _reduced(world, chunk, rank * chunk, device=device)
        return Buffers(lambda: reduce_scatter_single(out, source, group=group), out.zero_,
                       lambda: _expect(collective, out, want, dtype, rank)), numel * item
    if collective == "all_to_all":
        # chunk d of rank r's input goes to rank d; it carries positions (r·n + d)·chunk …
        source = torch.cat([_pattern(rank, chunk, (rank * world + d) * chunk, **make) for d in range(world)])
        out = torch.empty(numel, **make)
        want = torch.cat([_pattern(r, chunk, (r * world + rank) * chunk, dtype=torch.float64, device=device)
                          for r in range(world)])
        return Buffers(lambda: dist.all_to_all_single(out, source, group=group), out.zero_,
                       lambda: _expect(collective, out, want, dtype, rank)), numel * item
    if collective == "all_to_all_moe":
        tokens = numel // moe_row_elems
        counts = moe_routing(world, tokens, moe_skew, seed) * moe_row_elems  # elements src → dst
        send, recv = counts[rank].tolist(), counts[:, rank].tolist()
        starts = torch.cumsum(counts, dim=1) - counts  # where chunk src → dst starts in src's input
        source = torch.cat([_pattern(rank, send[d], (rank * world + d) * numel, **make) for d in range(world)])
        out = torch.empty(sum(recv), **make)
        want = torch.cat([_pattern(r, recv[r], (r * world + rank) * numel, dtype=torch.float64, device=device)
                          for r in range(world)])
        assert int(starts[rank, -1] + counts[rank, -1]) == numel
        return Buffers(lambda: dist.all_to_all_single(out, source, recv, send, group=group), out.zero_,
                       lambda: _expect(collective, out, want, dtype, rank)), numel * item
    if collective == "send_recv":
        peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
        source, out = _pattern(rank, numel, **make), torch.empty(numel, **make)
        want = _pattern(peer_from, numel, dtype=torch.float64, device=device)
        ops = [dist.P2POp(dist.isend, source, dist.get_global_rank(group, peer_to), group),
               dist.P2POp(dist.irecv, out, dist.get_global_rank(group, peer_from), group)]

        def exchange() -> None:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

        return Buffers(exchange, out.zero_, lambda: _expect(collective, out, want, dtype, rank)), numel * item
    raise ValueError(f"unknown collective {collective!r}; one of {', '.join(COLLECTIVES)}")


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """nccl-tests' ``-b min -e max -f factor``: min, min·f, min·f², … up to max (inclusive)."""
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes
