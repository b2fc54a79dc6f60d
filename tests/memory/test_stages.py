"""ZeRO stage layouts (memory/stages.py) against the seeds' per-rank formulas and element coverage."""

import pytest

from infinity.memory.stages import STAGES, chunk_numels, padded_numel, stage_for
from infinity.memory.tier import Kind
from stage_formulas import FORMULAS

SUB = 4096


def stored(stage, flat, trainable, world, sub=SUB):
    """Per rank: elements stored of params, grads and the update range (master / each moment)."""
    return [stage_for(stage).layout(flat, trainable, world, r, sub) for r in range(world)]




@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_bytes_per_rank_meet_the_formulas(stage, world):
    psi = 3 * 40_000 + 17  # not a multiple of the world size: padding is the only difference
    pad = padded_numel(psi, world) - psi
    for lay in stored(stage, psi, psi, world):
        measured = lay.params.numel * 2 + lay.grads.numel * 4 + lay.update.numel * 12
        assert abs(measured - FORMULAS[stage](psi, world)) <= pad * 18 + 18, (stage, world, measured)
        assert abs(stage_for(stage).bytes_per_rank(psi, world) - FORMULAS[stage](psi, world)) <= 1


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_update_ranges_cover_the_trainable_elements_once(stage, world):
    flat, trainable = 50_000, 30_001  # trainable first, then frozen
    layouts = stored(stage, flat, trainable, world, sub=8192)
    owners = [0] * trainable
    for lay in layouts:
        u = lay.update
        for i in range(u.start, u.start + u.numel):
            owners[i] += 1
        # the optimizer's chunk c holds the same elements in params and grads
        for c in range(u.update_chunks):
            start = u.start + u.chunk_start(u.first_chunk + c)
            for kind in (Kind.PARAMS, Kind.GRADS):
                k = lay.of(kind)
                kc = lay.optimizer_chunk(kind, c)
                assert k.start + k.chunk_start(kc) == start, (stage, world, kind, c)
                assert k.chunks[kc] == u.chunks[u.first_chunk + c]
    expected = 1 if stage_for(stage).optimizer_partitioned else world
    assert set(owners) == {expected}
    assert all(lay.params.numel >= lay.grads.numel >= 0 for lay in layouts)
    assert all(lay.grads.numel <= trainable for lay in layouts)


def test_frozen_weights_have_no_gradient_or_optimizer_state():
    for stage in STAGES:
        for lay in stored(stage, 10_000, 0, 2):
            assert lay.grads.numel == lay.update.numel == 0
            assert lay.params.numel > 0


@pytest.mark.parametrize("world", [2, 3])
def test_communication_per_step(world):
    psi = 1000
    assert [stage_for(s).comm_elements(psi, world) for s in STAGES] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]
    assert stage_for(3).comm_elements(psi, world, grad_accum_steps=2) == 6 * psi
    assert stage_for(1).comm_elements(psi, world, grad_accum_steps=2) == 2 * psi
    assert stage_for(3).comm_elements(psi, 1) == 0


def test_chunks_are_aligned():
    assert chunk_numels(10_000, 4096) == (4096, 4096, 1808)
    assert chunk_numels(0, 4096) == ()
