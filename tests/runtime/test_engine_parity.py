"""The engine trains exactly like plain PyTorch: every placement, world sizes 1 and 2, fp32.

Reference: single-process `torch.optim.AdamW` with weight decay, global-norm
clipping that clips, and 2 micro-batches of gradient accumulation.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import run_distributed
from engine_runs import ALL_PLACEMENTS, LATIN_PLACEMENTS, all_placements_on_rank, engine_run
from reference import Recipe, reference_run

RECIPE = Recipe()


@pytest.fixture(scope="module")
def reference():
    losses, norms, state = reference_run(RECIPE)
    assert all(n > RECIPE.grad_clip for n in norms), f"clipping must actually clip: pre-clip norms {norms}"
    return losses, norms, state


def assert_matches(reference, losses, norms, state, what):
    ref_losses, ref_norms, ref_state = reference
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda m: f"{what} losses: {m}")
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float32), torch.tensor(ref_norms),
                               msg=lambda m: f"{what} grad norms: {m}")
    assert list(state) == list(ref_state), f"{what}: state_dict keys differ"
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=lambda m, k=key: f"{what} {k}: {m}")


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("placement", ALL_PLACEMENTS, ids=lambda p: "-".join(p.values()))
def test_world_size_1_matches_pytorch(reference, placement, overlap, tmp_path):
    swap = str(tmp_path / "swap") if "nvme" in placement.values() else None
    losses, norms, state, report = engine_run(
        RECIPE, placement, swap, {"overlap": {"optimizer_with_backward": overlap}}
    )
    assert report["update_mode"] == ("DeferredUpdate" if overlap else "InlineUpdate")  # RECIPE clips
    assert_matches(reference, losses, norms, state, f"world 1 {placement} overlap={overlap}")


@pytest.mark.parametrize("overlap,placements", [
    pytest.param(False, None, marks=pytest.mark.slow), pytest.param(True, None, marks=pytest.mark.slow),
    (True, LATIN_PLACEMENTS)], ids=["sequential", "overlap", "overlap-latin"])
def test_world_size_2_matches_pytorch_every_placement(reference, overlap, placements, tmp_path):
    """World 2, every placement (CI: the 9 of a Latin square, each tier three times for each kind; `-m slow`:
    all 27, with and without overlap)."""
    results = run_distributed(all_placements_on_rank, 2, RECIPE, str(tmp_path), overlap, placements)
    for placement, losses, norms, state in results[0]:
        assert_matches(reference, losses, norms, state, f"world 2 {placement} overlap={overlap}")
    assert all(state == {} for _, _, _, state in results[1]), "full_state_dict is gathered on rank 0 only"


NO_CLIP = Recipe(grad_clip=0.0)


SLOW = pytest.mark.slow
EAGER_CASES = [  # CI: the middle placement at world 1 (world 2's eager update: test_zero_stages); `-m slow`: all six
    pytest.param(ALL_PLACEMENTS[0], 1, marks=SLOW),
    (ALL_PLACEMENTS[13], 1),
    pytest.param(ALL_PLACEMENTS[-1], 1, marks=SLOW),
    pytest.param(ALL_PLACEMENTS[0], 2, marks=SLOW),
    pytest.param(ALL_PLACEMENTS[13], 2, marks=SLOW),
    pytest.param(ALL_PLACEMENTS[-1], 2, marks=SLOW)]


@pytest.mark.parametrize("placement,world", EAGER_CASES,
                         ids=lambda p: "-".join(p.values()) if isinstance(p, dict) else str(p))
def test_eager_overlap_is_bitwise_the_sequential_step(placement, world, tmp_path):
    """Without clipping, units are updated during backward; the result is bit for bit the sequential one."""
    ref_losses, _, ref_state = reference_run(NO_CLIP)
    runs = {}
    for overlap in (False, True):
        swap = str(tmp_path / f"swap{overlap}")
        args = (NO_CLIP, placement, swap, overlap)
        runs[overlap] = _run_on_rank(0, 1, *args) if world == 1 else run_distributed(_run_on_rank, world, *args)[0]
    (seq_losses, seq_state, seq_mode), (ovl_losses, ovl_state, ovl_mode) = runs[False], runs[True]
    assert (seq_mode, ovl_mode) == ("InlineUpdate", "EagerUpdate")
    assert seq_losses == ovl_losses
    assert all(torch.equal(seq_state[k], ovl_state[k]) for k in seq_state)
    torch.testing.assert_close(torch.tensor(ovl_losses), torch.tensor(ref_losses))
    for key in ref_state:
        torch.testing.assert_close(ovl_state[key], ref_state[key])


def _run_on_rank(rank, world, recipe, placement, swap, overlap):
    swap = f"{swap}-{rank}" if "nvme" in placement.values() else None
    losses, _, state, report = engine_run(recipe, placement, swap, {"overlap": {"optimizer_with_backward": overlap}},
                                          rank=rank, world=world)
    return losses, state, report["update_mode"]
