"""Bad placements, budgets and paths fail at initialize with the bytes and the fix; bad steps are named."""

from __future__ import annotations

import math
import re

import pytest
import torch

import infinity
from reference import Recipe


def test_budget_too_small_names_bytes_and_a_placement_that_fits(tmp_path):
    cfg = {"placement": {"params": "device", "grads": "device", "optimizer": "device"},
           "memory": {"device_budget": "700KiB", "host_budget": "64MiB"}, "nvme": {"paths": [str(tmp_path)]}}
    with pytest.raises(infinity.PlacementError) as e:
        infinity.initialize(Recipe().build(), cfg)
    msg = str(e.value)
    assert "memory.device_budget" in msg and "bytes" in msg and "needs" in msg
    assert "A placement that fits" in msg and "[placement]" in msg
    # The suggested placement really fits.
    suggested = dict(re.findall(r'(params|grads|optimizer) = "(\w+)"', msg.split("[placement]")[1]))
    assert set(suggested) == {"params", "grads", "optimizer"}, msg
    cfg["placement"] = suggested
    infinity.initialize(Recipe().build(), cfg).close()


def test_budget_with_no_fitting_placement_says_so():
    cfg = {"memory": {"device_budget": "1KiB", "host_budget": "1KiB"}}
    with pytest.raises(infinity.PlacementError, match="No placement fits"):
        infinity.initialize(Recipe().build(), cfg)


def test_missing_nvme_path(tmp_path):
    cfg = {"placement": {"params": "nvme", "grads": "host", "optimizer": "host"},
           "nvme": {"paths": [str(tmp_path / "absent")]}}
    with pytest.raises(infinity.PreflightError, match="does not exist.*mkdir -p"):
        infinity.initialize(Recipe().build(), cfg)


def test_auto_policy_fits_a_host_budget_too_small_for_everything_on_host(tmp_path):
    small_groups = {"optimizer": {"sub_group_size": 4096}}  # NVMe staging small beside the state, as in real models
    all_host = {"placement": {"params": "host", "grads": "host", "optimizer": "host"}, **small_groups}
    with infinity.initialize(Recipe().build(), all_host) as engine:
        totals = engine.plan.tier_totals()
    need_host, need_device = totals[infinity.Tier.HOST], totals[infinity.Tier.DEVICE]
    cfg = {"placement": {"policy": "auto"},
           "memory": {"device_budget": str(need_device), "host_budget": str(need_host // 2)},
           "nvme": {"paths": [str(tmp_path)]}, **small_groups}
    with pytest.raises(infinity.PlacementError):
        infinity.initialize(Recipe().build(), {**cfg, "placement": all_host["placement"]})
    with infinity.initialize(Recipe().build(), cfg) as engine:
        state = engine.memory_report()["state"]
        assert sum(state["nvme"].values()) > 0, "auto moved some state to NVMe"
        assert engine.plan.tier_totals()[infinity.Tier.HOST] <= need_host // 2


def test_backward_without_forward_is_explained():
    with infinity.initialize(Recipe().build(), {}) as engine:
        with pytest.raises(RuntimeError, match="needs a forward"):
            engine.backward(torch.tensor(1.0, requires_grad=True))


def test_closed_engine_is_explained():
    engine = infinity.initialize(Recipe().build(), {})
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.zeros(1, 4, dtype=torch.long))


def _nan_steps(on_nonfinite):
    recipe = Recipe()
    engine = infinity.initialize(recipe.build(), recipe.config() | {"train": {"grad_accum_steps": 1,
                                                                              "on_nonfinite": on_nonfinite}})
    x, y = recipe.batches()[0][0]
    before = engine.full_state_dict()
    loss = engine(x, y) * math.nan
    engine.backward(loss)
    return engine, before


def test_nonfinite_gradients_raise_when_configured():
    engine, _ = _nan_steps("error")
    with engine, pytest.raises(infinity.NonFiniteGradError, match="on_nonfinite"):
        engine.step()


def test_nonfinite_gradients_skip_when_configured():
    engine, before = _nan_steps("skip")
    with engine:
        assert engine.step() is False
        after = engine.full_state_dict()
        for key in before:
            assert torch.equal(before[key], after[key]), key
        x, y = Recipe().batches()[0][0]
        engine.backward(engine(x, y))
        assert engine.step() is True, "the next window trains normally"


class _HeadInRoot(torch.nn.Module):
    """Blocks in a ModuleList, an untied head in the root unit: a plain backward reaches a root gradient first."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x, y):
        for block in self.blocks:
            x = torch.tanh(block(x))
        return torch.nn.functional.cross_entropy(self.head(x), y)


@pytest.mark.parametrize("build", [lambda: Recipe().build(), _HeadInRoot], ids=["gpt", "head_in_root"])
def test_plain_loss_backward_is_refused_and_leaves_nothing_behind(build):
    # Note [plain backward]: loss.backward() used to run silently and train nothing (step() returned False). The
    # refusal must leave no gradient behind: two steps after it equal, bitwise, two steps of an engine that never
    # saw it (whose parity with torch.optim.AdamW test_engine_parity.py checks); two, since Adam's first step
    # does not see a gradient's scale
    g = torch.Generator().manual_seed(1)
    if build is _HeadInRoot:
        batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(2)]
    else:
        batches = [step[0] for step in Recipe(steps=2).batches()]
    cfg = {"optimizer": {"lr": 1e-2}, "overlap": {"optimizer_with_backward": False}}
    trained = []
    for misuse in (True, False):
        torch.manual_seed(0)
        with infinity.initialize(build(), cfg) as engine:
            if misuse:
                with pytest.raises(RuntimeError, match=r"call engine.backward\(loss\) instead"):
                    engine(*batches[0]).backward()
            for batch in batches:
                engine.backward(engine(*batch))
                assert engine.step() is True
            trained.append(engine.full_state_dict())
    for name, value in trained[1].items():
        assert torch.equal(trained[0][name], value), name


def test_unit_classes_that_match_nothing_are_a_config_error():
    # was a ValueError: `infinity train --set units.classes='["NoSuchBlock"]'` printed a traceback, not exit 2
    with pytest.raises(infinity.ConfigError, match=r"units.classes = \['NoSuchBlock'\] matches no module.*'Block'"):
        infinity.initialize(Recipe().build(), {"units": {"classes": ["NoSuchBlock"]}})


def test_an_unwritable_profile_directory_is_refused_at_start(tmp_path):
    # it was found at close, after the training: a completed `infinity train` ended in a traceback, exit 1
    (tmp_path / "file").write_text("")
    cfg = {"profile": {"enabled": True, "trace_dir": str(tmp_path / "file" / "trace")}}
    refused = r"(?s)profile.trace_dir = .*file is a file.*profile.enabled = false"
    with pytest.raises(infinity.PreflightError, match=refused):
        infinity.initialize(Recipe().build(), cfg)
    cfg["profile"]["trace_dir"] = str(tmp_path / "new" / "trace")  # not there yet: created when written
    infinity.initialize(Recipe().build(), cfg).close()


def test_a_model_in_an_open_engine_is_refused_until_closed():
    # Note [one engine per model]: a second initialize of the same model (a notebook cell run again) was accepted,
    # and both engines then failed at their first forward with a message about engine.module(...)
    recipe = Recipe()
    model = recipe.build()
    x, y = recipe.batches()[0][0]
    engine = infinity.initialize(model, recipe.config())
    with pytest.raises(RuntimeError, match=r"already in an open Engine.*call close\(\)"):
        infinity.initialize(model, recipe.config())
    engine.backward(engine(x, y))  # the first engine is untouched
    engine.close()
    with infinity.initialize(model, recipe.config()) as again:  # closed: the model (now trained) starts anew
        again.backward(again(x, y))


def test_parameters_the_engine_frees_are_released_at_close(tmp_path):
    # Note [released parameters]: with parameters on NVMe a read of one after close (or between steps of the
    # model's own, outside a forward) read the freed unsharded buffer: the process died of a segfault
    recipe = Recipe()
    x, y = recipe.batches()[0][0]
    model = recipe.build()
    cfg = recipe.config(params="nvme", grads="host", optimizer="host") | {"nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(model, cfg) as engine:
        engine.backward(engine(x, y))
        engine.step()
    assert all(p.is_meta for p in model.parameters()), "meta, not views of freed bytes (checked before a read)"
    assert [p.shape for p in model.parameters()] == [p.shape for p in recipe.build().parameters()]
    with pytest.raises(RuntimeError, match="meta"):  # a call of the model: an error, not a segfault
        model(x, y)
    with pytest.raises(RuntimeError, match=r"released its parameters.*build the model again"):
        infinity.initialize(model, cfg)
    kept = recipe.build()  # stored whole on the compute device: the parameters alias the trained values
    with infinity.initialize(kept, recipe.config(params="host", grads="host", optimizer="host")) as engine:
        engine.backward(engine(x, y))
        engine.step()
        trained = engine.full_state_dict()
    for name, p in kept.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_model_state_dict_of_parameters_the_engine_holds_is_refused(tmp_path):
    # Note [model state_dict]: torch.save(model.state_dict()) with parameters on NVMe wrote storages of no bytes,
    # found only when the file was loaded; model.load_state_dict() never reached the masters
    recipe = Recipe()
    window = recipe.batches()[0]
    model = recipe.build()
    cfg = recipe.config(params="nvme", grads="host", optimizer="host") | {"nvme": {"paths": [str(tmp_path)]}}
    with infinity.initialize(model, cfg) as engine:
        for x, y in window:
            engine.backward(engine(x, y))
        assert engine.step()
        with pytest.raises(RuntimeError, match=r"model.state_dict\(\): the parameters of .* engine.full_state_dict"):
            model.state_dict()
        assert set(engine.full_state_dict()) == set(recipe.build().state_dict())  # the engine's own still work
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    kept = recipe.build()  # aliased to the stored values: the model's state_dict is the trained weights
    with infinity.initialize(kept, recipe.config(params="host", grads="host", optimizer="host")) as engine:
        for x, y in window:
            engine.backward(engine(x, y))
        assert engine.step()
        trained, own = engine.full_state_dict(), kept.state_dict()
        assert all(torch.equal(own[k], v) for k, v in trained.items())
        # loading into it wrote the compute-dtype parameters only, under masters the next step would write back
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\) on a model in an open Engine.*weights="):
            kept.load_state_dict(recipe.build().state_dict())
