"""engine.export_state_dict(DIR): a Hugging Face directory that transformers (and PEFT) load back.

The reference is transformers / PEFT themselves: from_pretrained of the exported directory gives the
engine's own logits, and the files carry the keys save_pretrained writes for the same model.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import infinity
from hf_tiny import HOST, config, logits, model_class, on_meta, reference, train
from infinity.state.export import export_checkpoint

peft = pytest.importorskip("peft")
from safetensors import safe_open  # noqa: E402

TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}  # GPT-2's Conv1D is fan_in_fan_out


def keys_in(directory) -> set[str]:
    keys = set()
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "pt") as f:
                keys |= set(f.keys())
    return keys


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("export_hf")
    refs = {}
    for kind in ("llama", "gpt2"):
        refs[kind] = reference(kind)
        refs[kind].save_pretrained(root / kind)
    return root, refs


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_dir_from_pretrained_gives_engine_logits(base, tmp_path, kind):
    root, _ = base
    out = tmp_path / "hf"
    with infinity.initialize(on_meta(kind), HOST, weights=str(root / kind)) as engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        engine.export_state_dict(str(out))
    files = set(os.listdir(out)) - {"config.json", "generation_config.json"}  # Note [stand-alone export]
    assert files == {"model.safetensors"}, "one file under max_shard_size, as save_pretrained"
    assert keys_in(out) == keys_in(root / kind), "save_pretrained's keys (GPT-2: the tied lm_head left out)"
    back = model_class(kind).from_pretrained(out).eval()
    assert not torch.equal(logits(back), logits(reference(kind))), "trained: not the initial weights"
    torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)


def test_sharded_export_and_its_index(base, tmp_path):
    root, _ = base
    out = tmp_path / "hf"
    limit = 20_000  # "20KB": decimal, as transformers means it
    with infinity.initialize(on_meta("llama"), HOST, weights=str(root / "llama")) as engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        engine.export_state_dict(str(out), max_shard_size="20KB")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
        assert len(shards) > 2 and shards == sorted(set(index["weight_map"].values()))
        assert all(n == f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i, n in enumerate(shards, 1))
        sizes = {}
        for name in shards:
            with safe_open(str(out / name), "pt") as f:
                sizes[name] = [f.get_slice(k).get_shape() for k in f.keys()]
        for name, shapes in sizes.items():
            nbytes = sum(4 * torch.Size(s).numel() for s in shapes)
            assert nbytes <= limit or len(shapes) == 1, (name, nbytes)
        assert index["metadata"]["total_size"] == sum(4 * torch.Size(s).numel() for v in sizes.values() for s in v)
        assert keys_in(out) == set(index["weight_map"]) == keys_in(root / "llama")
        config("llama").save_pretrained(out)
        back = model_class("llama").from_pretrained(out).eval()
        torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)
        assert sorted(os.listdir(tmp_path)) == ["hf"], "the export's temporary checkpoint is gone"
        engine.save_checkpoint(f"{out}.checkpoint")
        engine.wait_for_checkpoint()
    export_checkpoint(f"{out}.checkpoint", str(out))  # again, one file: the earlier shards and index go
    assert sorted(n for n in os.listdir(out) if "safetensors" in n) == ["model.safetensors"]


def peft_engine(kind, root):
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind], lora_dropout=0.0)
    model = peft.get_peft_model(on_meta(kind), lora)
    return lora, infinity.initialize(model, HOST, weights=str(root / kind))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_merge_lora_writes_merged_base_weights(base, tmp_path, kind):
    root, _ = base
    out = tmp_path / "merged"
    _, engine = peft_engine(kind, root)
    with engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        lora_b = [v for k, v in engine.full_state_dict().items() if ".lora_B." in k]
        assert all(v.abs().sum() > 0 for v in lora_b), "trained adapters (B no longer zero)"
        engine.export_state_dict(str(out), merge_lora=True)
    assert keys_in(out) == keys_in(root / kind), "the base model's own names, no adapter"
    config(kind).save_pretrained(out)
    back = model_class(kind).from_pretrained(out).eval()
    torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)


def test_adapters_alone_as_peft_saves_them(base, tmp_path):
    root, refs = base
    out = tmp_path / "adapters"
    lora, engine = peft_engine("llama", root)
    with engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        engine.export_state_dict(str(out))
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    own = peft.get_peft_model(copy.deepcopy(refs["llama"]), copy.deepcopy(lora))
    own.save_pretrained(tmp_path / "peft_own")
    assert keys_in(out) == keys_in(tmp_path / "peft_own"), "PEFT's own adapter key names"
    back = peft.PeftModel.from_pretrained(model_class("llama").from_pretrained(root / "llama"), str(out)).eval()
    torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)


def test_an_engines_export_releases_the_heap_after_each_tensor_it_writes(base, tmp_path):
    """Note [heap release]: the export holds one tensor at a time, and with `release_heap` the engine's policy runs
    after each one it writes (without it glibc kept 60-110 MiB of a 38M-parameter export's freed pages); the
    engine's default keeps the pages (planted: no release in the export; the count is 0 and this fails)."""
    root, _ = base
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS["llama"], lora_dropout=0.0)
    model = peft.get_peft_model(on_meta("llama"), lora)
    calls = []
    with infinity.initialize(model, HOST | {"memory": {"release_heap": True}}, weights=str(root / "llama")) as engine:
        engine.heap.release = lambda: calls.append(1)  # (counted instead of trimmed)
        engine.export_state_dict(str(tmp_path / "merged"), merge_lora=True)
    assert len(calls) == len(keys_in(tmp_path / "merged")), (len(calls), len(keys_in(tmp_path / "merged")))
