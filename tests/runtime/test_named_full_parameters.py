"""named_full_parameters: the engine's weights streamed unit by unit into a second transformers model (the
inference side of RL post-training) give the engine's logits bit for bit; at most one unit's full values are
alive at a time (measured: the gathered units still referenced at each yield); a LoRA model's merged weights
are PEFT's own merge_and_unload."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch

import infinity
import infinity.runtime.colocate as colocate
from hf_tiny import HOST, logits, model_class, on_meta, reference, train
from hf_tiny import config as hf_config


@pytest.mark.parametrize("stage", [0, 3])
def test_streamed_weights_rebuild_the_model_with_equal_logits(stage, monkeypatch):
    ref = reference("llama")
    cfg = {**HOST, "placement": {"params": "device", "grads": "device", "optimizer": "device"},
           "zero": {"stage": stage}}
    with infinity.initialize(on_meta("llama"), cfg, weights=ref.state_dict()) as engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        gathered, peak = [], [0]
        real = colocate.gather_unit_master

        def tracked(unit, manager, every_rank=False):
            full = real(unit, manager, every_rank)
            gathered.append(weakref.ref(full))
            return full

        monkeypatch.setattr(colocate, "gather_unit_master", tracked)
        target = model_class("llama")(hf_config("llama")).eval()  # fresh random weights, all replaced
        params = dict(target.named_parameters())
        for name, value in engine.named_full_parameters():
            alive = [r() for r in gathered if r() is not None]
            peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in alive))
            with torch.no_grad():
                params.pop(name).copy_(value)
            del value, alive
        assert not params
        largest_unit = max(u.padded_numel for u in engine.units) * 4  # fp32 values
        assert len(gathered) == len(engine.units) and peak[0] == largest_unit
    assert torch.equal(logits(target), want)


def test_lora_merged_is_peft_merge(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    ref = reference("llama")
    with infinity.initialize(peft.get_peft_model(on_meta("llama"), copy.deepcopy(lora)), HOST,
                             weights=ref.state_dict()) as engine:
        train(engine)
        trained = engine.full_state_dict()
        merged = dict(engine.named_full_parameters(dtype="fp32", merge_lora=True))
        unmerged = [n for n, _ in engine.named_full_parameters()]
    own = peft.get_peft_model(copy.deepcopy(ref), copy.deepcopy(lora))
    own.load_state_dict(trained)
    want = own.merge_and_unload().state_dict()
    assert any(".lora_B." in n for n in unmerged), "unmerged: the PEFT model's own names"
    assert merged.keys() == dict(ref.named_parameters()).keys(), "the base model's names"
    for k, v in merged.items():
        assert torch.equal(v, want[k]), k


def test_a_dtype_name_it_does_not_know_is_named_with_the_choices():
    # was a bare KeyError: 'half'
    from reference import Recipe
    with infinity.initialize(Recipe().build(), {}) as engine:
        with pytest.raises(ValueError, match=r"dtype 'half': use one of 'fp32', 'bf16', 'fp16' or a torch dtype"):
            engine.named_full_parameters(dtype="half")
        assert next(iter(engine.named_full_parameters(dtype="bf16")))[1].dtype == torch.bfloat16
