"""Host staging bytes of the NVMe optimizer update (optim/offloaded.py, optim/read_ahead.py):
what the pool of aligned buffers ends up holding.

Used by preflight (the locked-memory check) and `infinity estimate` (Note [peak memory]).
"""

from __future__ import annotations

from io_engine import size_class

from ..memory.placement import Plan
from ..memory.tier import Kind, Tier
from .read_ahead import largest_chunk_bytes


def staging_pool_bytes(plan: Plan, *, read_ahead: int = 1, max_writes_in_flight: int = 4) -> int:
    """Host staging bytes the pool ends up holding: a replay of two optimizer steps' buffer requests.

    Mirrors `optim.offloaded.OffloadedOptimizer` (read `read_ahead` tasks ahead, at most
    `max_writes_in_flight` stores pending, the last stores left pending into the next step)
    over the size classes of `io_engine.AlignedBufferPool`, which keeps every buffer it
    allocated. Only NVMe shards are staged on the host; resident ones are used in place.
    """
    csize = plan.compute_dtype.itemsize
    live: dict[int, int] = {}
    peak: dict[int, int] = {}

    def get(nbytes: int) -> int | None:
        if nbytes == 0:
            return None
        c = size_class(nbytes, 4096)
        live[c] = live.get(c, 0) + 1
        peak[c] = max(peak.get(c, 0), live[c])
        return c

    def put(c: int | None) -> None:
        if c is not None:
            live[c] -= 1

    tasks = [(u, n) for u, sizes in enumerate(plan.units) for n in sizes.chunk_numels]
    nvme = lambda u, k: plan.tier(u, k) is Tier.NVME  # noqa: E731
    left: dict[int, list] = {}  # task -> buffers of its stores still pending from the last step
    for _step in range(2):
        for task, pending in left.items():
            for is_params, c in pending:
                put(c if is_params else None)  # the forward's parameter fetch waits the pending parameter write
            left[task] = [(False, c) for is_params, c in pending if not is_params]
        ahead, writes, nxt = [], [], 0
        for _ in tasks:
            while nxt < len(tasks) and len(ahead) <= read_ahead:
                u, n = tasks[nxt]
                for _, c in left.pop(nxt, []):
                    put(c)  # fetching a chunk waits its pending write first
                ahead.append((nxt, u, n, {k: get(n * 4) if nvme(u, k) else None
                                          for k in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.GRADS)}))
                nxt += 1
            task, u, n, bufs = ahead.pop(0)
            alias = plan.aliases_master(u)  # the master's buffer is the parameters' (Note [aliased parameters])
            params = get(n * csize) if nvme(u, Kind.PARAMS) and not alias else None
            writes += [(task, alias and k is Kind.MASTER, bufs[k]) for k in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)]
            if not alias:
                writes.append((task, True, params))
            put(bufs[Kind.GRADS])  # released right after the step
            while len(writes) > max_writes_in_flight:
                put(writes.pop(0)[2])
        for task, is_params, c in writes:
            left.setdefault(task, []).append((is_params, c))
    return sum(c * n for c, n in peak.items())


def host_staging_bytes(plan: Plan, read_ahead: int, fresh: int = 0, max_writes_in_flight: int = 4) -> int:
    """The host staging pool: the update pipeline's buffers; with a state read-ahead, the held state plus the
    write-behind of the chunks the update has taken from it (the pool recycles one into the other); plus the
    parameters kept after their write (Note [fresh parameters])."""
    if not plan.uses(Tier.NVME):
        return 0
    pipeline = staging_pool_bytes(plan, max_writes_in_flight=max_writes_in_flight)
    if not read_ahead:
        return pipeline + fresh
    one_kind = largest_chunk_bytes(plan) // 3  # the largest sub-group of one state kind
    return max(pipeline, read_ahead + max_writes_in_flight * one_kind) + fresh
