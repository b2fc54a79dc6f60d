"""ZeRO stages 0-3 (issue 23): every stage trains like single-process torch AdamW at world sizes 1, 2 and 3, with
the optimizer on host and on NVMe, overlap off and on; the collectives move what `Stage.comm_elements` says; a
checkpoint saved at one stage and world size resumes at another.

One launch per world size runs every case in turn (tests/helpers/zero_runs.py), so the suite pays three launches.
"""

from __future__ import annotations

import os

import pytest
import torch

from dist_utils import run_distributed
from infinity.memory.stages import STAGES, stage_for
from reference import FrozenRecipe, Recipe, reference_run
from zero_runs import Case, cases_on_rank

CLIP = Recipe(micro_batch=6, steps=3)  # 6 sequences split evenly over 1, 2 or 3 ranks; clipping clips
NO_CLIP = Recipe(micro_batch=6, steps=3, grad_clip=0.0)  # lets the eager update mode run
PLACEMENTS = [{"params": "device", "grads": "device", "optimizer": "host"},  # aliased whole parameters
              {"params": "host", "grads": "host", "optimizer": "nvme"},
              {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}]
SPECULATED = Recipe(micro_batch=6, steps=3, extra={"overlap": {"speculation": "64MiB"}})  # ("auto": none w/o GPU)
MODES = {"InlineUpdate": (CLIP, False), "SpeculativeUpdate": (SPECULATED, True), "EagerUpdate": (NO_CLIP, True),
         "DeferredUpdate": (CLIP, True)}
WORLDS = (1, 2, 3)
FROZEN = FrozenRecipe(micro_batch=6, steps=3)  # most weights frozen: partitions of trainable and frozen elements
NVME = PLACEMENTS[2]


def cases(world: int, root: str) -> list[Case]:
    """Every stage on every placement, the update mode turning with the stage, so each stage runs each mode and
    each placement; the first placement saves a checkpoint after step 1, the second resumes from the one the
    previous world size saved at the next stage."""
    def mode_of(stage: int, p: int) -> str:
        return list(MODES)[(stage + p) % len(MODES)]

    out = []
    for stage in STAGES:
        for p, placement in enumerate(PLACEMENTS):
            mode = mode_of(stage, p)
            recipe, overlap = MODES[mode]
            save = os.path.join(root, f"ckpt-w{world}-s{stage}") if p == 0 else None
            load = None
            if p == 1 and world > 1:  # the next stage whose saver ran the same recipe
                saver = next(s for s in ((stage + k) % 4 for k in (1, 2, 3)) if MODES[mode_of(s, 0)][0] is recipe)
                load = os.path.join(root, f"ckpt-w{world - 1}-s{saver}")
            out.append((mode, Case(recipe, stage, placement, overlap, save=save, load=load)))
    if world == 3:
        out += [("DeferredUpdate", Case(FROZEN, stage, NVME, True)) for stage in (0, 1, 2)]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """world -> [(mode, case, rank 0's result, every rank's collective bytes)]; world sizes in order (each resumes
    the previous one's checkpoints)."""
    root = str(tmp_path_factory.mktemp("zero"))
    out = {}
    for world in WORLDS:
        listed = cases(world, root)
        args = ([c for _, c in listed], root)  # (world 1 in this process: a spawn costs seconds of imports)
        per_rank = [cases_on_rank(0, 1, *args)] if world == 1 else run_distributed(cases_on_rank, world, *args)
        out[world] = [(mode, case, per_rank[0][i], [r[i]["collective_bytes"] for r in per_rank])
                      for i, (mode, case) in enumerate(listed)]
    return out


@pytest.fixture(scope="module")
def references():
    return {key(recipe): reference_run(recipe) for recipe in (CLIP, NO_CLIP, FROZEN)}


def key(recipe: Recipe) -> tuple:
    return type(recipe).__name__, recipe.grad_clip  # (a Recipe is no dict key)


@pytest.mark.parametrize("world", WORLDS)
def test_every_stage_matches_pytorch(runs, references, world):
    for mode, case, result, _ in runs[world]:
        what = f"world {world} stage {case.stage} {case.placement} {mode}" + (" resumed" if case.load else "")
        assert result["mode"] == mode, what
        # whole parameters stored in the compute device's memory are the stored tensor itself, at any world size
        # (the device here is the CPU, whose memory the host tier is too)
        aliased = case.placement["params"] != "nvme" and (case.stage < 3 or world == 1)
        assert result["aliased"] == [aliased] * len(result["aliased"]), what
        ref_losses, ref_norms, ref_state = references[key(case.recipe)]
        skip = result["first"]  # steps done before the checkpoint it resumed from
        assert (skip > 0) == (case.load is not None), what
        torch.testing.assert_close(torch.tensor(result["losses"]),
                                   torch.tensor(ref_losses[skip * case.recipe.accum:]), msg=lambda m: f"{what}: {m}")
        if case.recipe.grad_clip > 0:
            torch.testing.assert_close(torch.tensor(result["norms"], dtype=torch.float32),
                                       torch.tensor(ref_norms[skip:]), msg=lambda m: f"{what} grad norms: {m}")
        assert list(result["state"]) == list(ref_state), what
        for name in ref_state:
            torch.testing.assert_close(result["state"][name], ref_state[name], msg=lambda m, k=name: f"{what} {k}: {m}")


@pytest.mark.parametrize("world", WORLDS)
def test_a_backward_fills_the_trainable_prefix_unless_a_reduce_scatter_needs_the_whole_unit(runs, world):
    """Note [trainable flat gradient]: each unit's flat gradient is its trainable elements [0, T) at one rank and at
    stage 0 (all-reduced), the whole padded unit where stages 1-3 reduce-scatter it over several ranks; with frozen
    weights (world 3) the two differ (planted: the whole unit always; the frozen cases at stage 0 fail)."""
    for mode, case, result, _ in runs[world]:
        what = f"world {world} stage {case.stage} {case.placement['params']} {mode}"
        for (padded, _, trainable), flats in zip(result["units"], result["flats"]):
            assert flats == {padded if world > 1 and case.stage > 0 else trainable}, (what, flats, padded, trainable)
    assert world < 3 or any(t < p for _, c, r, _ in runs[world] for p, _, t in r["units"] if c.stage == 0)


def test_checkpoints_resume_across_stages_and_world_sizes(runs):
    """A checkpoint saved after step 1 at world size W - 1 and stage s resumes at world size W and a stage other
    than s, for every stage (the resumed run's losses and final weights are checked above)."""
    for world in (2, 3):
        resumed = {c.stage: c.load for _, c, r, _ in runs[world] if c.load and r["first"] == c.split}
        assert set(resumed) == set(STAGES), (world, resumed)
        assert all(f"-w{world - 1}-" in path and not path.endswith(f"-s{s}") for s, path in resumed.items()), resumed


def expected_elements(stage: int, units: list[tuple[int, int, int]], world: int, accum: int) -> int:
    """Per steady step: `comm_elements` of each unit's padded size, except that stage 0 all-reduces only the
    trainable elements (all of the padded unit when nothing is frozen), and stage 3 gathers the root unit once
    per micro-batch, not twice (it stays unsharded from its forward to the end of the backward)."""
    s = stage_for(stage)
    if world == 1:
        return 0
    total = sum(s.comm_elements(trainable if stage == 0 else padded, world, accum) for padded, _, trainable in units)
    return total - (accum * units[0][0] if s.gathers_params else 0)


@pytest.mark.parametrize("world", WORLDS)
def test_collective_bytes_per_step_match_the_stage(runs, world):
    """Note [collective bytes]: each step's bytes on the all-gather, reduce-scatter and all-reduce links, over
    the element sizes (parameters in the compute dtype, gradients fp32), are the stage's communication per
    step (stages 0-2: 2 per element; stage 3: 3 per element and micro-batch), padding included. The first
    step has no update before it, so stages 1-2 gather nothing in it."""
    for mode, case, result, per_rank in runs[world]:
        what = f"world {world} stage {case.stage} {case.placement['params']} {mode}"
        units, accum = result["units"], case.recipe.accum
        if case.recipe is FROZEN:  # Ψ counts the trainable elements' gradients: checked against the units only
            psi = padding = 0
        else:
            psi = sum(flat for _, flat, _ in units)
            padding = sum(padded - flat for padded, flat, _ in units)
        expected = expected_elements(case.stage, units, world, accum)
        if psi:
            assert abs(expected - stage_for(case.stage).comm_elements(psi, world, accum)) <= (
                3 * accum * padding + 2 * accum * units[0][0]), what  # the formula of Ψ, up to padding and the root
        for rank, steps in enumerate(per_rank):
            elements = [s["all_gather"] // result["itemsize"] + s["reduce_scatter"] // 4 + s["all_reduce"] // 4
                        for s in steps]
            assert len(elements) == case.recipe.steps - result["first"], what
            assert elements[1:] == [expected] * (len(elements) - 1), (what, rank, elements, expected)
            gathers_after_update = stage_for(case.stage).gathers_after_update
            if not case.load and world > 1:
                assert (steps[0]["all_gather"] == 0) == (case.stage in (0, 1, 2)), (what, steps[0])
                if gathers_after_update:
                    assert elements[0] == expected - sum(p for p, _, _ in units), (what, rank, elements)
