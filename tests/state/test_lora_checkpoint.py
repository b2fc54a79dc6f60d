"""LoRA checkpoints of adapter size: the frozen base weights are saved as references to the pretrained files
(Note [pretrained references]), resume is bitwise the uninterrupted run, and a changed or missing pretrained
directory is refused naming the file and the fix.

The references are plain PyTorch / transformers: the base model's own save_pretrained files, the adapters'
element count from the PEFT model itself, and the uninterrupted run of the same engine.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

import infinity
from hf_tiny import HOST, VOCAB, on_meta, reference
from infinity.machine.preflight import checkpoint_bytes, checkpoint_metadata
from infinity.state.checkpoint import CheckpointError
from infinity.state.export import export_checkpoint

peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

STEPS, SAVED_AT = 4, 2
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """The tiny llama saved by transformers, in fp32 and in bf16 (file dtype = compute dtype, or a cast)."""
    root = tmp_path_factory.mktemp("lora_ckpt")
    model = reference("llama")
    for name, dtype in DTYPES.items():
        model.to(dtype).save_pretrained(root / name)
    return root


def cfg(compute: str = "fp32", **checkpoint) -> dict:
    return {**HOST, "precision": {"compute_dtype": compute}, "checkpoint": checkpoint}


def lora_engine(weights, config: dict, r: int = 4):
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return infinity.initialize(peft.get_peft_model(on_meta("llama"), lora), config,
                               weights=None if weights is None else str(weights))


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(100 + step))


def train(engine, first: int, last: int) -> list[float]:
    losses = []
    for step in range(first, last):
        x = batch(step)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def saved(weights, ckpt, config: dict) -> list[float]:
    """SAVED_AT steps of a LoRA run from `weights`, then a checkpoint at `ckpt`."""
    with lora_engine(weights, config) as engine:
        losses = train(engine, 0, SAVED_AT)
        engine.save_checkpoint(str(ckpt))
    return losses


def resumed(weights, ckpt, config: dict) -> tuple[list[float], dict]:
    with lora_engine(weights, config) as engine:
        engine.load_checkpoint(str(ckpt))
        return train(engine, SAVED_AT, STEPS), engine.full_state_dict()


def uninterrupted(weights, config: dict) -> tuple[list[float], dict]:
    with lora_engine(weights, config) as engine:
        return train(engine, 0, STEPS), engine.full_state_dict()


def files_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path))


def adapter_numel(r: int = 4) -> int:
    lora = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(on_meta("llama"), lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def frozen_numel() -> int:
    return sum(p.numel() for p in on_meta("llama").parameters())


def flip_byte(path) -> None:
    """One byte in the middle of the first tensor's data (past the 8-byte length and the JSON header)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        begin, end = next(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        at = 8 + n + (begin + end) // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("r", [2, 4])
def test_a_lora_checkpoint_is_a_few_times_the_adapters_and_their_adam_state(bases, tmp_path, r):
    ckpt = tmp_path / "ckpt"
    with lora_engine(bases / "fp32", cfg(), r=r) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(str(ckpt))
        planned = checkpoint_bytes(engine.plan, frozen_referenced=True) - checkpoint_metadata(engine.plan)
    assert os.path.getsize(ckpt / "rank00000.bin") == planned
    n = adapter_numel(r)
    master, moments = 4 * n, 2 * 4 * n  # fp32 master of the adapters, Adam's exp_avg and exp_avg_sq
    size = files_bytes(ckpt)
    assert size < 5 * (master + moments), (size, n)
    assert size < frozen_numel(), "the frozen base (not even one byte per element) is not in it"
    index = json.loads((ckpt / "rank00000.json").read_text())
    assert {rec["kind"] for rec in index["records"]} == {"master", "exp_avg", "exp_avg_sq", "pretrained"}
    assert sum(rec["numel"] for rec in index["records"] if rec["kind"] == "pretrained") == frozen_numel()


@pytest.mark.parametrize("init,compute", [("pretrained", "bf16"), ("random", "fp32"),  # (the other two: -m slow)
                                          pytest.param("pretrained", "fp32", marks=pytest.mark.slow),
                                          pytest.param("random", "bf16", marks=pytest.mark.slow)])
def test_resume_from_a_reference_checkpoint_is_bitwise_the_uninterrupted_run(bases, tmp_path, compute, init):
    """init: the resuming engine reads the pretrained directory itself (as the job does), or starts from random
    weights and gets the frozen ones from the references alone."""
    base, config = bases / compute, cfg(compute)
    full_losses, full_state = uninterrupted(base, config)
    first = saved(base, tmp_path / "ckpt", config)
    losses, state = resumed(base if init == "pretrained" else None, tmp_path / "ckpt", config)
    assert first + losses == full_losses
    assert list(state) == list(full_state) and all(torch.equal(state[k], full_state[k]) for k in state)


def test_a_resumed_run_saves_references_again_and_they_resume_bitwise(bases, tmp_path, monkeypatch):
    """The references of a loaded checkpoint carry over: its next save is small again, and resumes exactly.
    (Tensors referenced in pieces of 1000 elements, as a big model's are in pieces of REF_PIECE.)"""
    from infinity.state import weights
    monkeypatch.setattr(weights, "REF_PIECE", 1000)
    base, config = bases / "fp32", cfg()
    full_losses, full_state = uninterrupted(base, config)
    first = saved(base, tmp_path / "a", config)
    with lora_engine(None, config) as engine:
        engine.load_checkpoint(str(tmp_path / "a"))
        first += train(engine, SAVED_AT, SAVED_AT + 1)
        engine.save_checkpoint(str(tmp_path / "b"))
    assert files_bytes(tmp_path / "b") < 2 * files_bytes(tmp_path / "a")
    with lora_engine(None, config) as engine:
        engine.load_checkpoint(str(tmp_path / "b"))
        losses, state = train(engine, SAVED_AT + 1, STEPS), engine.full_state_dict()
    assert first + losses == full_losses
    assert all(torch.equal(state[k], full_state[k]) for k in full_state)


def test_a_changed_pretrained_file_is_refused_naming_it_and_the_fix(bases, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(bases / "bf16", base)
    saved(base, tmp_path / "ckpt", cfg())
    flip_byte(base / "model.safetensors")
    for weights in (None, base):  # the references alone, or the job's way (initialized from the changed files)
        with pytest.raises(CheckpointError) as err:
            resumed(weights, tmp_path / "ckpt", cfg())
        message = str(err.value)
        assert str(base / "model.safetensors") in message and "differ from those it was saved with" in message
        assert "restore the pretrained directory" in message and "reference_pretrained = false" in message


def test_a_missing_or_resized_pretrained_directory_is_refused_before_anything_is_loaded(bases, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(bases / "fp32", base)
    saved(base, tmp_path / "ckpt", cfg())
    with open(base / "model.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(CheckpointError, match="bytes, .* when the checkpoint was saved: the pretrained weights"):
        resumed(None, tmp_path / "ckpt", cfg())
    shutil.rmtree(base)
    with pytest.raises(CheckpointError, match=f"{base / 'model.safetensors'} is missing: {base} does not exist"):
        resumed(None, tmp_path / "ckpt", cfg())
    with pytest.raises(CheckpointError, match="restore the pretrained directory"):
        export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))


def test_the_export_of_a_reference_checkpoint_holds_the_complete_weights(bases, tmp_path):
    with lora_engine(bases / "fp32", cfg()) as engine:
        train(engine, 0, SAVED_AT)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.full_state_dict()
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "out.safetensors"))
    exported = load_file(str(tmp_path / "out.safetensors"))
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected)
    base = load_file(str(bases / "fp32" / "model.safetensors"))
    assert torch.equal(exported["base_model.model.model.embed_tokens.weight"], base["model.embed_tokens.weight"])


def test_full_checkpoints_hold_frozen_weights_once_in_their_own_dtype_and_stand_alone(bases, tmp_path):
    """reference_pretrained = false (and frozen weights not read from a safetensors file): bf16 bytes, not fp32."""
    base = tmp_path / "base"
    shutil.copytree(bases / "bf16", base)
    config = cfg("bf16", reference_pretrained=False)
    full_losses, full_state = uninterrupted(base, config)
    first = saved(base, tmp_path / "ckpt", config)
    index = json.loads((tmp_path / "ckpt" / "rank00000.json").read_text())
    frozen = [rec for rec in index["records"] if rec["kind"] == "params"]
    assert {rec["dtype"] for rec in frozen} == {"bf16"} and not any(r["kind"] == "pretrained" for r in index["records"])
    assert sum(rec["numel"] for rec in frozen) == frozen_numel()  # each once, padding not written
    size = os.path.getsize(tmp_path / "ckpt" / "rank00000.bin")
    assert size < 2 * frozen_numel() + 12 * adapter_numel() + 4096 * len(index["records"])  # (+ alignment)
    shutil.rmtree(base)  # the checkpoint needs no pretrained directory
    losses, state = resumed(None, tmp_path / "ckpt", config)
    assert first + losses == full_losses
    assert all(torch.equal(state[k], full_state[k]) for k in full_state)


def test_a_pretrained_file_changed_during_the_run_is_copied_not_referenced(bases, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(bases / "fp32", base)
    with lora_engine(base, cfg()) as engine:
        train(engine, 0, 1)
        os.utime(base / "model.safetensors", ns=(1, 1))  # size or mtime changed: the run's values are the old ones
        with pytest.warns(UserWarning, match="pretrained files changed since this run read them"):
            engine.save_checkpoint(str(tmp_path / "ckpt"))
        expected = engine.full_state_dict()
    index = json.loads((tmp_path / "ckpt" / "rank00000.json").read_text())
    assert not any(rec["kind"] == "pretrained" for rec in index["records"])
    shutil.rmtree(base)
    with lora_engine(None, cfg()) as engine:
        engine.load_checkpoint(str(tmp_path / "ckpt"))
        state = engine.full_state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_a_full_fine_tune_checkpoint_is_unchanged(bases, tmp_path):
    """No frozen parameters: masters and moments in fp32, no references, the same records as before."""
    with infinity.initialize(reference("llama"), cfg(), weights=str(bases / "fp32")) as engine:
        train(engine, 0, 1)
        engine.save_checkpoint(str(tmp_path / "ckpt"))
        numel = sum(u.flat_numel for u in engine.units)
        padded = sum(u.stored_trainable for u in engine.units)
    index = json.loads((tmp_path / "ckpt" / "rank00000.json").read_text())
    kinds = [rec["kind"] for rec in index["records"]]
    assert set(kinds) == {"master", "exp_avg", "exp_avg_sq"} and {r["dtype"] for r in index["records"]} == {"fp32"}
    assert sum(rec["numel"] for rec in index["records"]) == 3 * padded >= 3 * numel


def _save_at_world_two(rank, world, base, ckpt):
    with lora_engine(base, {**cfg(), "zero": {"stage": 3}}) as engine:  # each rank read its partition's pieces
        train(engine, 0, SAVED_AT)
        engine.save_checkpoint(ckpt)
        return engine.full_state_dict()


@pytest.mark.slow  # (spawns two processes: ~30 s here)
def test_references_saved_at_world_two_load_at_world_one_and_are_saved_again(bases, tmp_path):
    from dist_utils import run_distributed
    expected = run_distributed(_save_at_world_two, 2, str(bases / "fp32"), str(tmp_path / "w2"))[0]
    for ckpt, then in ((tmp_path / "w2", tmp_path / "w1"), (tmp_path / "w1", None)):
        with lora_engine(None, cfg()) as engine:
            engine.load_checkpoint(str(ckpt))
            state = engine.full_state_dict()
            if then is not None:
                engine.save_checkpoint(str(then))  # the loaded references (both ranks' pieces) carry over
        assert list(state) == list(expected) and all(torch.equal(state[k], expected[k]) for k in expected)
    index = json.loads((tmp_path / "w1" / "rank00000.json").read_text())
    assert sum(rec["numel"] for rec in index["records"] if rec["kind"] == "pretrained") == frozen_numel()


@pytest.mark.gpu
def test_gpu_lora_with_pretrained_references_resumes_and_exports(bases, tmp_path):
    """The GPU twin (issue 42): a LoRA run on the device whose checkpoint refers to the pretrained files
    resumes bit for bit, and its export holds the complete weights."""
    for sub in ("resume", "export"):
        (tmp_path / sub).mkdir()
    test_resume_from_a_reference_checkpoint_is_bitwise_the_uninterrupted_run(bases, tmp_path / "resume", "bf16",
                                                                             "pretrained")
    test_the_export_of_a_reference_checkpoint_holds_the_complete_weights(bases, tmp_path / "export")
