"""Parameter groups and the optimizer surface (issue 30): `initialize(param_groups=)` and `[optimizer] no_decay`
train exactly as plain torch.optim.AdamW with the same groups, at each placement, world 1 and 3, every update mode;
`engine.set_lr`, `engine.lr` and torch LR schedulers on `engine.optimizer`; groups through checkpoints; refusals.

The groupings (nanoGPT's decay-on->=2-D rule, HF Trainer's no-decay names, two learning rates) are written out in
tests/helpers/groups_runs.py. Tiny GPT, 3 steps of 2 micro-batches: the whole file runs in about 20 s.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import infinity
from dist_utils import run_distributed
from groups_runs import (
    GROUPINGS,
    WD,
    GroupCase,
    group_run,
    groups_on_rank,
    hf_no_decay_names,
    nanogpt_groups,
    reference_groups_run,
    two_lr_groups,
)
from infinity.optim.groups import resolve_groups
from infinity.state.checkpoint_files import CheckpointError
from reference import Recipe

CLIP = Recipe(micro_batch=6, steps=3)  # accumulation 2, clipping at 0.5 (it clips), weight decay 0.1
NO_CLIP = Recipe(micro_batch=6, steps=3, grad_clip=0.0)  # lets the eager update mode run
SMALL_CHUNKS = {"optimizer": {"sub_group_size": 700}}  # groups' runs cut across sub-group boundaries


def check_parity(case: GroupCase, losses, mode, state, what=""):
    ref_losses, ref_state = reference_groups_run(case.recipe, GROUPINGS[case.grouping])
    what = what or f"{case}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), msg=lambda m: f"{what} losses: {m}")
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=lambda m, k=key: f"{what} {k}: {m}")


WORLD1 = [
    GroupCase("nanogpt", "device", recipe=CLIP),
    GroupCase("nanogpt", "host", overlap=True, recipe=CLIP, extra=SMALL_CHUNKS),  # deferred
    GroupCase("nanogpt", "nvme", overlap=True, recipe=NO_CLIP),  # eager
    GroupCase("hf", "device", overlap=True, recipe=NO_CLIP),
    GroupCase("hf", "host", recipe=CLIP),
    GroupCase("hf", "nvme", overlap=True, recipe=CLIP, extra=SMALL_CHUNKS),
    GroupCase("two_lr", "device", overlap=True, recipe=CLIP, extra=SMALL_CHUNKS),
    GroupCase("two_lr", "host", overlap=True, recipe=NO_CLIP),
    GroupCase("two_lr", "nvme", recipe=CLIP, extra=SMALL_CHUNKS),
]
MODE = {(False, True): "InlineUpdate", (False, False): "InlineUpdate", (True, True): "DeferredUpdate",
        (True, False): "EagerUpdate"}


@pytest.mark.parametrize("case", WORLD1, ids=lambda c: f"{c.grouping}-{c.placement}-ovl{int(c.overlap)}")
def test_groups_match_torch_adamw(case, tmp_path):
    losses, mode, state = group_run(case, str(tmp_path / "swap"))
    assert mode == MODE[(case.overlap, case.recipe.grad_clip > 0)]
    check_parity(case, losses, mode, state)


WORLD3 = [
    GroupCase("nanogpt", "nvme", overlap=True, recipe=CLIP, stage=3),
    GroupCase("hf", "host", recipe=CLIP, stage=1, extra=SMALL_CHUNKS),
    GroupCase("two_lr", "device", overlap=True, recipe=NO_CLIP, stage=0),
    GroupCase("nanogpt", "host", overlap=True, recipe=CLIP, stage=2),
]


def test_groups_match_torch_adamw_at_world_3(tmp_path):
    """One launch of 3 gloo ranks runs every case (ranks split the 6 sequences of each micro-batch)."""
    results = run_distributed(groups_on_rank, 3, WORLD3, str(tmp_path))[0]
    for case, (losses, mode, state) in zip(WORLD3, results):
        check_parity(case, losses, mode, state, what=f"world 3 {case}")


def test_no_decay_rule_is_hf_trainers(tmp_path):
    """`bias_and_norm` picks what transformers' Trainer.get_decay_parameter_names leaves out, and patterns are
    searched in names; the groups are the ones `initialize` uses."""
    model = CLIP.build()
    cfg = infinity.Config.from_dict({"optimizer": {"no_decay": ["bias_and_norm"], "weight_decay": WD}}).optimizer
    groups = resolve_groups(model, cfg, None)
    assert set(groups.groups[1]["params"]) == hf_no_decay_names(model) and groups.groups[1]["weight_decay"] == 0.0
    assert groups.groups[0]["weight_decay"] == WD
    transformers = pytest.importorskip("transformers")
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, model)) & set(dict(model.named_parameters()))
    assert set(groups.groups[0]["params"]) == decayed
    cfg = infinity.Config.from_dict({"optimizer": {"no_decay": [r"^wpe\.", r"\.fc\."]}}).optimizer
    off = set(resolve_groups(model, cfg, None).groups[1]["params"])
    assert off == {n for n, _ in model.named_parameters() if n.startswith("wpe.") or ".fc." in n}


def _assert_same(a, b):
    torch.testing.assert_close(torch.tensor(a[0]), torch.tensor(b[0]))
    for key in b[1]:
        torch.testing.assert_close(a[1][key], b[1][key], msg=lambda m, k=key: f"{k}: {m}")


@pytest.mark.filterwarnings("error")  # torch warns of a scheduler stepped before its optimizer: it must not
@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "deferred"])
def test_torch_lambda_lr_on_engine_optimizer(overlap):
    """LambdaLR(engine.optimizer) stepped after the step equals LambdaLR on torch AdamW with the same groups:
    the scheduler writes param_groups[i]["lr"] and the next update uses it. Inline steps through
    engine.optimizer.step(), deferred through engine.step(): the same call."""
    lam = lambda k: 1.0 / (k + 1)  # noqa: E731 - 1, 1/2, 1/3: each group's lr follows its own base
    model = CLIP.build()
    cfg = CLIP.config(params="host", grads="host", optimizer="host")
    cfg["overlap"] = {"optimizer_with_backward": overlap}
    engine = infinity.initialize(model, cfg, param_groups=two_lr_groups(model))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lam)
    losses = []
    try:
        for micro_batches in CLIP.batches():
            for x, y in micro_batches:
                loss = engine(x, y)
                engine.backward(loss)
                losses.append(loss.item())
            if overlap:
                engine.step()
            else:
                engine.optimizer.step()  # = engine.step()
            engine.optimizer.zero_grad()  # does nothing
            scheduler.step()
        state = engine.full_state_dict()
        assert engine.lr == pytest.approx([3e-3 * lam(3), CLIP.lr * lam(3)])
    finally:
        engine.close()
    _assert_same((losses, state), reference_groups_run(CLIP, two_lr_groups, lr_lambda=lam))


def test_set_lr_and_builtin_schedule():
    """`[optimizer]` warmup gives every group its lr times (k + 1) / warmup; `engine.set_lr` then takes over:
    the same as torch AdamW whose group lrs are set by hand at the same steps."""
    recipe = Recipe(micro_batch=6, steps=4, extra={})
    warmup = 2
    set_at = {2: [1e-3, 5e-4]}  # at step 2: per group

    def drive(engine, step):
        if step in set_at:
            engine.set_lr(set_at[step])
        if step == 3:
            engine.set_lr(2e-4)  # one number: every group
        assert engine.lr == pytest.approx(expected[step])

    bases = [3e-3, recipe.lr]
    expected = [[b * (k + 1) / warmup for b in bases] for k in range(warmup)] + [set_at[2], [2e-4, 2e-4]]
    model = recipe.build()
    cfg = recipe.config(params="device", grads="device", optimizer="device")
    cfg["optimizer"]["warmup_steps"] = warmup
    engine = infinity.initialize(model, cfg, param_groups=two_lr_groups(model))
    losses = []
    try:
        for step, micro_batches in enumerate(recipe.batches()):
            drive(engine, step)
            for x, y in micro_batches:
                loss = engine(x, y)
                engine.backward(loss)
                losses.append(loss.item())
            engine.step()
        state = engine.full_state_dict()
    finally:
        engine.close()
    ref = _reference_with_lrs(recipe, two_lr_groups, expected)
    _assert_same((losses, state), ref)


def _reference_with_lrs(recipe, groups_of, lrs_per_step):
    model = recipe.build()
    opt = torch.optim.AdamW(groups_of(model), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
                            weight_decay=recipe.weight_decay)
    losses = []
    for lrs, micro_batches in zip(lrs_per_step, recipe.batches()):
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        for x, y in micro_batches:
            loss = model(x, y)
            (loss / recipe.accum).backward()
            losses.append(loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, model.state_dict()


def test_lr_schedule_argument_scales_groups():
    """`lr_schedule=` (a number: the lr of a group at optimizer.lr, others scaled by their lr) per group."""
    recipe = Recipe(micro_batch=6, steps=3)
    model = recipe.build()
    schedule = lambda k: recipe.lr * 0.5 ** k  # noqa: E731
    engine = infinity.initialize(model, recipe.config(), param_groups=two_lr_groups(model), lr_schedule=schedule)
    try:
        assert engine.lr == pytest.approx([3e-3, recipe.lr])
        for micro_batches in recipe.batches():
            for x, y in micro_batches:
                engine.backward(engine(x, y))
            engine.step()
        assert engine.lr == pytest.approx([3e-3 * 0.125, recipe.lr * 0.125])
        assert [g["lr"] for g in engine.param_groups] == engine.lr
    finally:
        engine.close()
    model = recipe.build()
    per_group = lambda k: [1e-3 / (k + 1), 2e-3]  # noqa: E731 - a list: one lr per group
    with infinity.initialize(model, recipe.config(), param_groups=two_lr_groups(model), lr_schedule=per_group) as e:
        assert e.lr == [1e-3, 2e-3]
        e.optimizer_steps = 3  # (what the schedule is asked for: the next update's index)
        assert e.lr == [2.5e-4, 2e-3]
    with pytest.raises(ValueError, match="returned 2 learning rates for 1 parameter groups"):  # at initialize
        infinity.initialize(recipe.build(), recipe.config(), lr_schedule=lambda k: [1e-3, 1e-3])


# ----------------------------------------------------------------- checkpoints


def test_checkpoint_keeps_groups_and_refuses_others(tmp_path):
    """Save after 1 step with the two-lr groups, resume in a new engine and train 2 more: equals 3 straight
    steps of torch AdamW; a run with other groups (nanoGPT's) is refused with the fix, before any state
    changes; the same groups with another weight_decay load (hyper-parameters are the resuming run's)."""
    recipe, ckpt = CLIP, str(tmp_path / "ckpt")
    swap = str(tmp_path / "swap")
    os.makedirs(swap)

    def make(groups):
        model = recipe.build()
        cfg = recipe.config(params="nvme", grads="host", optimizer="nvme")
        cfg["nvme"] = {"paths": [swap]}
        return infinity.initialize(model, cfg, param_groups=groups(model))

    from engine_runs import train_steps
    engine = make(two_lr_groups)
    try:
        losses = train_steps(engine, recipe, 0, 1, 0, 1)
        engine.set_lr([2e-3, 1e-3])  # the user's lrs are restored with the checkpoint
        engine.save_checkpoint(ckpt)
    finally:
        engine.close()
    engine = make(two_lr_groups)
    try:
        engine.load_checkpoint(ckpt)
        assert engine.lr == [2e-3, 1e-3]
        engine.set_lr([3e-3, recipe.lr])
        losses += train_steps(engine, recipe, 1, recipe.steps, 0, 1)
        state = engine.full_state_dict()
    finally:
        engine.close()
    _assert_same((losses, state), reference_groups_run(recipe, two_lr_groups))
    engine = make(nanogpt_groups)
    try:
        with pytest.raises(CheckpointError, match="other parameter groups: group 0 holds other parameters"
                                                  ".*param_groups="):
            engine.load_checkpoint(ckpt)
        assert engine.optimizer_steps == 0
    finally:
        engine.close()
    engine = make(lambda m: [dict(g, weight_decay=0.05) for g in two_lr_groups(m)])
    try:
        engine.load_checkpoint(ckpt)
        assert engine.optimizer_steps == 1 and [g["weight_decay"] for g in engine.param_groups] == [0.05, 0.05]
    finally:
        engine.close()


# ----------------------------------------------------------------- refusals


def _groups_error(groups, **optimizer):
    model = CLIP.build()
    cfg = infinity.Config.from_dict({"optimizer": optimizer}).optimizer
    with pytest.raises(infinity.ConfigError) as info:
        resolve_groups(model, cfg, groups(model))
    return str(info.value)


def test_refusals():
    named = lambda m: dict(m.named_parameters())  # noqa: E731
    msg = _groups_error(lambda m: [{"params": list(m.parameters()), "momentum": 0.9}])
    assert "unknown key(s) ['momentum']" in msg
    msg = _groups_error(lambda m: [{"params": list(m.parameters())}, {"params": [named(m)["wte.weight"]]}])
    assert "'wte.weight' is in param_groups[0] and param_groups[1]" in msg and "exactly one group" in msg
    msg = _groups_error(lambda m: [{"params": [p for n, p in m.named_parameters() if n != "wpe.weight"]}])
    assert "1 trainable parameter(s) are in no group: wpe.weight" in msg
    msg = _groups_error(lambda m: [{"params": ["wte.weight", "no.such"]}])
    assert "'no.such' is not a trainable parameter" in msg
    msg = _groups_error(lambda m: [{"params": list(m.parameters())}], no_decay=["bias_and_norm"])
    assert "both param_groups= and optimizer.no_decay" in msg
    msg = _groups_error(lambda m: [{"params": list(m.parameters()), "betas": (0.9, 1.5)}])
    assert "betas = (0.9, 1.5) must be a pair of numbers in [0, 1)" in msg
    msg = _groups_error(lambda m: [{"params": list(m.parameters()), "amsgrad": True}])
    assert "amsgrad = True is not supported" in msg
    msg = _groups_error(lambda m: torch.optim.Adam(m.parameters()).param_groups)  # [optimizer] name = "adamw"
    assert 'decoupled_weight_decay = False is not supported (infinity runs AdamW' in msg and '"adam"' in msg
    msg = _groups_error(lambda m: {"params": list(m.parameters())})
    assert "param_groups must be a list of dicts" in msg
    with pytest.raises(infinity.ConfigError, match="optimizer.no_decay.*not a regular expression"):
        infinity.Config.from_dict({"optimizer": {"no_decay": ["(bias"]}})
    with pytest.raises(infinity.ConfigError, match="no_decay.*closest|did you mean"):
        infinity.Config.from_dict({"optimizer": {"no_decays": []}})


def test_engine_optimizer_surface():
    """engine.optimizer holds no state and no tensors; its groups are engine.param_groups (the same dicts)."""
    model = CLIP.build()
    engine = infinity.initialize(model, CLIP.config(), param_groups=two_lr_groups(model))
    try:
        opt = engine.optimizer
        assert opt.param_groups is engine.param_groups and len(opt.param_groups) == 2
        assert opt.state_dict()["state"] == {} and not opt.state
        assert all(isinstance(n, str) for g in engine.param_groups for n in g["params"])
        assert engine.param_groups[0]["betas"] == (0.8, 0.99) and engine.param_groups[1]["betas"] == CLIP.betas
        assert not opt.step()  # no backward yet: nothing to apply
        with pytest.raises(ValueError, match="groups are fixed at initialize"):
            opt.add_param_group({"params": ["wte.weight"]})
        with pytest.raises(ValueError, match="one learning rate >= 0, or a list of 2"):
            engine.set_lr([1.0])
        assert math.isclose(engine.lr[1], CLIP.lr)
    finally:
        engine.close()


def test_estimate_shows_groups_with_the_same_bytes(tmp_path):
    """`infinity estimate` takes `[optimizer] no_decay`, reports each group's counts, and plans the same bytes."""
    from infinity.config.job import ModelConfig
    from infinity.memory.cost_model import LinkRates
    from infinity.models.build import build_model
    from infinity.plan import estimate as est
    rates = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="t")
    small = ModelConfig(n_layer=2, d_model=48, n_head=4, seq_len=16, vocab_size=300)
    results = {}
    for rules in ([], ["bias_and_norm"]):
        config = infinity.Config.from_dict({"optimizer": {"no_decay": rules, "weight_decay": WD},
                                            "placement": {"params": "host", "grads": "host", "optimizer": "host"}})
        results[len(rules)] = est.estimate(lambda: build_model(small), config, batch_size=2, seq_len=16, rates=rates)
    plain, grouped = results[0], results[1]
    assert grouped.state() == plain.state() and grouped.state()
    model = build_model(small).model
    off = hf_no_decay_names(model)
    named = dict(model.named_parameters())
    expect = [(len(named) - len(off), sum(p.numel() for n, p in named.items() if n not in off), WD),
              (len(off), sum(named[n].numel() for n in off), 0.0)]
    assert [(g["tensors"], g["elements"], g["weight_decay"]) for g in grouped.groups] == expect
    text = est.format_estimate(grouped)
    assert f"optimizer groups: 2 ({expect[0][0]} tensors, {expect[0][1]:,} elements at weight_decay 0.1; " in text
    assert len(plain.groups) == 1 and plain.groups[0]["elements"] == expect[0][1] + expect[1][1]


def test_torch_forms_accepted_frozen_parameters_skipped():
    """As torch.optim: a plain list of parameters is one group; frozen parameters in a group are skipped (never
    stepped: their gradient is None); a parameter given under another name of a tied weight is the same one."""
    model = CLIP.build()
    cfg = infinity.Config().optimizer
    named = dict(model.named_parameters())
    assert resolve_groups(model, cfg, list(model.parameters())).groups[0]["params"] == list(named)
    named["wpe.weight"].requires_grad_(False)
    groups = resolve_groups(model, cfg, [{"params": list(model.parameters())}]).groups
    assert groups[0]["params"] == [n for n in named if n != "wpe.weight"]
    groups = resolve_groups(model, cfg, [{"params": [n for n in named]}, {"params": ["wpe.weight"]}]).groups
    assert groups[1]["params"] == []
    torch_groups = torch.optim.AdamW(nanogpt_groups(model), lr=2e-3, betas=(0.9, 0.99), fused=True).param_groups
    groups = resolve_groups(model, cfg, torch_groups).groups  # a torch AdamW's groups, as they are
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in groups] == [(2e-3, (0.9, 0.99), WD),
                                                                          (2e-3, (0.9, 0.99), 0.0)]
