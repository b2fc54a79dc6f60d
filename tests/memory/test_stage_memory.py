"""What each rank stores, by ZeRO stage and for frozen weights (issue 23's geometry, issue 24 item 3).

memory_report()'s bytes per kind against the seeds' per-rank formulas (tests/memory/test_stages.py FORMULAS, written
out independently of the layouts), the plan's byte model against the manager's allocations, frozen weights
costing only their parameter bytes (requires_grad_(False) and a peft LoRA Llama) while training as plain
PyTorch AdamW does, and checkpoints that load across stages and world sizes with every element written once.
"""

from __future__ import annotations

import glob
import json
import os
import zlib

import pytest
import torch

import infinity
from ckpt_runs import load_then_run, make_engine, run_then_save, states_equal, train_steps, uninterrupted
from dist_utils import run_distributed
from infinity.memory.tier import OPTIMIZER_KINDS, Kind
from infinity.memory.traffic import bytes_per_step
from reference import FrozenRecipe, Recipe, engine_losses, plain_adamw, reference_run
from stage_formulas import FORMULAS

HOST = {"params": "host", "grads": "host", "optimizer": "host"}
DEVICE = {"params": "device", "grads": "device", "optimizer": "device"}
NVME = {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}


def run(fn, world: int, *args) -> list:
    """`fn(rank, world, *args)` per rank: in this process at world size 1, else in gloo processes."""
    return [fn(0, 1, *args)] if world == 1 else run_distributed(fn, world, *args)


def per_kind(state: dict) -> dict[str, int]:
    """Bytes per group (params, grads, optimizer) summed over the tiers of a report's state section."""
    total = {k.value: sum(tier[k.value] for tier in state.values()) for k in Kind}
    return {"params": total["params"], "grads": total["grads"],
            "optimizer": sum(total[k.value] for k in OPTIMIZER_KINDS)}


# ---------------------------------------------------------------- the formulas, every stage


def _reports_by_stage(rank, world):
    out = {}
    for stage in (0, 1, 2, 3):
        cfg = Recipe().config(**HOST) | {"precision": {"compute_dtype": "bf16"}, "zero": {"stage": stage}}
        with infinity.initialize(Recipe().build(), cfg) as engine:
            report = engine.memory_report()
            out[stage] = (report["state"], report["plan"], len(engine.units))
    return out


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # (world 2 halves: test_engine_memory)
def test_memory_report_meets_the_formulas_at_every_stage(world):
    """Right after initialize (the stage's runtime behaviour is another layer): per rank, bf16 parameters,
    fp32 gradients and 12 bytes of optimizer state per element, as the stage partitions them."""
    psi = sum(p.numel() for p in Recipe().build().parameters())
    for rank_reports in run(_reports_by_stage, world):
        for stage, (state, plan, units) in rank_reports.items():
            got = per_kind(state)
            assert got == per_kind(plan), (stage, got, per_kind(plan))  # the byte model is what was allocated
            n = world
            expected = {  # each term of FORMULAS[stage], by kind (stage 0 divides nothing, stage 3 everything)
                "params": 2 * psi / (n if stage == 3 else 1),
                "grads": 4 * psi / (n if stage >= 2 else 1),
                "optimizer": 12 * psi / (n if stage >= 1 else 1),
            }
            assert abs(sum(expected.values()) - FORMULAS[stage](psi, n)) < 1
            for group, bytes_per_element in (("params", 2), ("grads", 4), ("optimizer", 12)):
                padding = units * (n - 1) * bytes_per_element  # each unit padded to a multiple of n
                assert abs(got[group] - expected[group]) <= padding, (stage, world, group, got, expected)


# ---------------------------------------------------------------- frozen weights


def _frozen_run(rank, world, recipe, placement, swap_root, stage):
    swap = os.path.join(swap_root, f"r{rank}")
    os.makedirs(swap, exist_ok=True)
    cfg = recipe.config(**placement) | {"nvme": {"paths": [swap]}, "zero": {"stage": stage}}
    with infinity.initialize(recipe.build(), cfg) as engine:
        report = engine.memory_report()
        losses = train_steps(engine, recipe, 0, recipe.steps, rank, world)
        return losses, engine.full_state_dict(), report["state"], report["plan"]


@pytest.mark.parametrize("world,placement,stage", [(1, DEVICE, 3), (1, NVME, 3), (1, HOST, 0),
                                                   pytest.param(2, HOST, 3, marks=pytest.mark.slow)],
                         ids=["w1-device", "w1-nvme", "w1-host-stage0", "w2-host"])
def test_frozen_weights_cost_only_their_weights_and_train_like_pytorch(world, placement, stage, tmp_path):
    recipe = FrozenRecipe(steps=3)
    model = recipe.build()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    psi = sum(p.numel() for p in model.parameters())
    assert trainable < psi // 5
    ref_losses, _, ref_state = reference_run(recipe, model)
    results = run(_frozen_run, world, recipe, placement, str(tmp_path), stage)
    totals = {g: sum(per_kind(r[2])[g] for r in results) for g in ("params", "grads", "optimizer")}
    for r in results:
        assert per_kind(r[2]) == per_kind(r[3])  # the plan counted what the manager allocated
    # fp32 compute: parameters 4 bytes per element, all of them (padding aside: stage 3 pads each unit to world)
    units = 4
    assert 0 <= totals["params"] - 4 * psi <= 4 * units * (world - 1), totals
    assert totals["grads"] == 4 * trainable, totals  # over the ranks: every trainable element once, nothing else
    assert totals["optimizer"] == 12 * trainable, totals
    losses, state = results[0][0], results[0][1]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key], msg=lambda m, k=key: f"{k}: {m}")
    for name, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(state[name], p.detach()), name  # frozen: exactly the initial values


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_frozen_weights_move_only_their_parameter_bytes(dtype, tmp_path):
    """Per step the disk moves what the byte model predicts (Note [traffic per step]) when most weights are
    frozen: their parameters are read for compute and never written; gradients and optimizer state move
    for trainable elements only."""
    recipe = FrozenRecipe(steps=2, accum=2)
    cfg = recipe.config(**NVME) | {"nvme": {"paths": [str(tmp_path)]}, "precision": {"compute_dtype": dtype},
                                   "overlap": {"optimizer_with_backward": False}}
    with infinity.initialize(recipe.build(), cfg) as engine:
        for step, micro in enumerate(recipe.batches()):
            before = dict(engine.manager.bytes_moved)
            for x, y in micro:
                engine.backward(engine(x, y))
            engine.step()
            engine.synchronize()
            moved = {k: v - before[k] for k, v in engine.manager.bytes_moved.items()}
            predicted = bytes_per_step(engine.plan, grad_accum_steps=recipe.accum, first_step=step == 0, cuda=False,
                                       kept=engine.kept_params)
            assert {k: moved[k] for k in ("nvme_read", "nvme_write")} == {
                k: predicted[k] for k in ("nvme_read", "nvme_write")}, (step, moved, predicted)


# ---------------------------------------------------------------- peft LoRA on a tiny Llama

VOCAB, SEQ = 96, 16


def lora_llama():
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None, pad_token_id=None))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # B = 0 would leave A without a gradient at the first step
    return model


def lm_loss(forward, batch):
    logits = forward(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def test_peft_lora_keeps_adam_state_for_the_adapters_only(tmp_path):
    model = lora_llama()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    psi = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(7)
    data = [torch.randint(0, VOCAB, (4, SEQ + 1), generator=g) for _ in range(3)]
    ref_losses, ref_state = plain_adamw(model, data, lm_loss, lr=3e-3, weight_decay=0.1)
    cfg = {"optimizer": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1, "grad_clip": 0.0},
           "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}, "nvme": {"paths": [str(tmp_path)]}}
    frozen_before = {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}
    with infinity.initialize(model, cfg) as engine:
        got = per_kind(engine.memory_report()["state"])
        losses = engine_losses(engine, data, lm_loss)
        state = engine.full_state_dict()
    assert got == {"params": 4 * psi, "grads": 4 * trainable, "optimizer": 12 * trainable}, (got, psi, trainable)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=key)
    for key, value in frozen_before.items():
        assert torch.equal(state[key], value), key


# ---------------------------------------------------------------- checkpoints across stages


def records_by_kind(ckpt: str) -> dict[str, int]:
    """Elements saved per kind over every rank file's records."""
    out: dict[str, int] = {}
    for path in glob.glob(os.path.join(ckpt, "rank*.json")):
        with open(path) as f:
            for rec in json.load(f)["records"]:
                out[rec["kind"]] = out.get(rec["kind"], 0) + rec["numel"]
    return out


def _save_at_init(rank, world, recipe, placement, root, ckpt, stage):
    with make_engine(recipe, placement, root, {"zero": {"stage": stage}}, rank) as engine:
        engine.save_checkpoint(ckpt, user_state={"next_step": 0})
        return engine.full_state_dict()


@pytest.mark.parametrize("stage", [0])
def test_replicated_kinds_are_saved_once_and_load_at_stage_3(stage, tmp_path):
    """At world 2, stage 0 stores parameters and optimizer state whole on both ranks (stages 1-2: parameters);
    the checkpoint holds each element once, and loads at stage 3 on one rank to the same values."""
    recipe = FrozenRecipe(steps=1)
    model = recipe.build()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    psi = sum(p.numel() for p in model.parameters())
    ckpt = str(tmp_path / "ckpt")
    saved = run_distributed(_save_at_init, 2, recipe, HOST, str(tmp_path), ckpt, stage)[0]
    counts = records_by_kind(ckpt)
    assert counts["master"] == counts["exp_avg"] == counts["exp_avg_sq"] == trainable, counts
    assert 0 <= counts["params"] - (psi - trainable) < 2 * 4, counts  # frozen weights (and padding), once
    loaded = run(_load_state, 1, recipe, HOST, str(tmp_path), ckpt, 3)[0]
    assert states_equal(loaded, saved)


def _load_state(rank, world, recipe, placement, root, ckpt, stage):
    with make_engine(recipe, placement, root, {"zero": {"stage": stage}}, rank) as engine:
        engine.load_checkpoint(ckpt)
        return engine.full_state_dict()


@pytest.mark.parametrize("saved,loaded", [pytest.param((3, 2), (2, 1), marks=pytest.mark.slow),
                                          pytest.param((0, 1), (3, 2), marks=pytest.mark.slow),  # (CI: in
                                          ((1, 1), (3, 1))],  # test_zero_stages' chain of resumes over worlds)
                         ids=["s3w2-to-s2w1", "s0w1-to-s3w2", "s1w1-to-s3w1"])
def test_checkpoint_resumes_at_another_stage_and_world_size(saved, loaded, tmp_path):
    """Trained state (masters, moments, frozen weights) saved at one stage and world size resumes at another
    as if uninterrupted. (Stages 0-2 run here at world size 1, where they need no collectives of their own.)"""
    recipe = FrozenRecipe(steps=4)
    root, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    (save_stage, save_world), (load_stage, load_world) = saved, loaded
    full_losses, _, full_state = reference_run(recipe, recipe.build())
    first = run(run_then_save, save_world, recipe, HOST, root, ckpt, 2, {"zero": {"stage": save_stage}})
    losses, state = run(load_then_run, load_world, recipe, HOST, root, ckpt, {"zero": {"stage": load_stage}})[0]
    torch.testing.assert_close(torch.tensor(first[0] + losses), torch.tensor(full_losses))
    for key in full_state:
        torch.testing.assert_close(state[key], full_state[key], msg=lambda m, k=key: f"{k}: {m}")


def _save_trained(rank, world, recipe, root, ckpt, stage):
    with make_engine(recipe, HOST, root, {"zero": {"stage": stage}}, rank) as engine:
        train_steps(engine, recipe, 0, 1, rank, world)
        engine.save_checkpoint(ckpt)
        return engine.full_state_dict()


def test_export_from_a_checkpoint_includes_the_frozen_weights(tmp_path):
    """Frozen weights are saved as params records (they have no master); an export streams them from there."""
    from safetensors.torch import load_file

    from infinity.state.export import export_checkpoint
    recipe = FrozenRecipe(steps=1)
    ckpt = str(tmp_path / "ckpt")
    state = run(_save_trained, 2, recipe, str(tmp_path), ckpt, 3)[0]
    exported = load_file(export_checkpoint(ckpt, str(tmp_path / "model.safetensors")))
    frozen = [n for n, p in recipe.build().named_parameters() if not p.requires_grad]
    assert frozen and all(exported[n].abs().sum() > 0 for n in frozen if n.endswith("weight"))  # (biases start 0)
    for key, value in state.items():
        torch.testing.assert_close(exported[key], value, msg=key)


def test_checkpoint_of_format_1_still_loads(tmp_path):
    """Format 1 (before stages): record ranges in the saving rank's shard, no flat offsets. A stage-3
    checkpoint of a model without frozen weights is that format once the flat offsets are dropped."""
    recipe = Recipe(steps=2)
    root, ckpt = str(tmp_path), str(tmp_path / "ckpt")
    run_distributed(run_then_save, 2, recipe, HOST, root, ckpt, 1)
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    for entry in manifest["ranks"]:
        path = os.path.join(ckpt, entry["index"])
        with open(path) as f:
            index = json.load(f)
        for rec in index["records"]:
            del rec["flat"]
        data = json.dumps(index).encode()
        with open(path, "wb") as f:
            f.write(data)
        entry["index_crc32"] = zlib.crc32(data)
    manifest["format"] = "infinity-checkpoint/1"
    del manifest["zero_stage"]
    with open(os.path.join(ckpt, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    full_losses, full_state = run(uninterrupted, 1, recipe, HOST, root)[0]
    losses, state = run(load_then_run, 1, recipe, HOST, root, ckpt)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(full_losses[-recipe.accum:]))
    for key in full_state:
        torch.testing.assert_close(state[key], full_state[key])
