"""The units' forward hooks inside a backward: a recomputed forward (Note [recomputed forward] in hooks.py).

Two kinds of recomputation fire them. A model that checkpoints its own blocks (Hugging Face's gradient
checkpointing, `torch.utils.checkpoint` in the user's forward) recomputes a block just before that block's
backward needs it: the unit's pre-hook is its pre-backward (unshard, and prefetch along the backward order),
and the unit then stays until its gradients are taken, as without recomputation. The engine's own
`[activation] checkpoint = "units"` of a block split into tiles (Note [tiles are units] in units/tiling.py)
recomputes the whole block in forward order: each tile is waited for with no prefetch (prefetching along the
backward's order from there would hold the whole block), and a tile the recomputation had to fetch is
released after its recomputed forward (its backward fetches it again), so a recomputation holds one tile at
a time, not the block.
"""

from __future__ import annotations

from typing import Callable

from infinity.units.unit import Unit, UnitState


class Recomputation:
    """`pre` / `post` for a forward hook fired inside a backward (UnitCallbacks.pre_recompute / post_recompute)."""

    def __init__(self, in_split_blocks: frozenset[int], pre_backward: Callable[[Unit], None], prefetcher, clock):
        self.in_split_blocks = in_split_blocks  # units inside a block checkpointed whole
        self.pre_backward, self.prefetcher, self.clock = pre_backward, prefetcher, clock
        self.fetched: set[int] = set()  # units this recomputation fetched (released after their forward)

    def pre(self, unit: Unit) -> None:
        if unit.index == 0:
            return  # the root stays unsharded until the backward ends
        if unit.index not in self.in_split_blocks:  # the model's own checkpoint: its backward follows at once
            self.pre_backward(unit)
            return
        if unit.state is UnitState.SHARDED and not unit.aliased:
            self.fetched.add(unit.index)
        self.clock.compute_end(f"recompute before {unit.name}")
        self.prefetcher.wait_for(unit)
        self.clock.compute_begin()

    def post(self, unit: Unit) -> bool:
        """Release what only the recomputation fetched; returns whether it was released."""
        if unit.index not in self.fetched:
            return False
        self.fetched.discard(unit.index)
        unit.reshard()
        return True

    def backward_ended(self) -> None:
        self.fetched.clear()
