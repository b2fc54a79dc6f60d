"""initialize(model, config, weights=PATH): pretrained weights streamed into the shards.

The reference is transformers: the same checkpoint loaded by transformers gives the same first logits;
the fp32 values the engine holds are the file's values (cast from bf16 exactly as torch casts).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import infinity
from dist_utils import run_distributed
from hf_tiny import HOST, logits, nvme, on_meta, reference
from infinity.state.weights import WeightsError

LAYOUTS = ["dir", "sharded", "file", "torch", "memory"]


def save(model, root, layout: str) -> str:
    """The checkpoint as a user has it: an HF directory (one file or shards + index), a .safetensors file, a
    torch state dict, or a state dict in memory (a copy: the reference model is not the source)."""
    if layout == "memory":
        return {key: value.clone() for key, value in model.state_dict().items()}
    path = os.path.join(root, layout)
    if layout == "torch":
        os.makedirs(root, exist_ok=True)
        torch.save(model.state_dict(), path + ".pt")
        return path + ".pt"
    model.save_pretrained(path, max_shard_size="20KB" if layout == "sharded" else "5GB")
    if layout == "sharded":
        assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return os.path.join(path, "model.safetensors") if layout == "file" else path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    refs = {kind: reference(kind) for kind in ("llama", "gpt2")}
    paths = {(kind, layout): save(refs[kind], str(root / kind), layout) for kind in refs for layout in LAYOUTS}
    return refs, paths


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_load_gives_transformers_logits(saved, kind, layout):
    refs, paths = saved
    with infinity.initialize(on_meta(kind), HOST, weights=paths[kind, layout]) as engine:
        engine.eval()
        torch.testing.assert_close(logits(engine), logits(refs[kind]), rtol=0, atol=1e-5)
        state = engine.full_state_dict()
    for key, value in refs[kind].state_dict().items():
        assert torch.equal(state[key], value), key


def test_load_into_nvme_tiers(saved, tmp_path):
    refs, paths = saved
    with infinity.initialize(on_meta("llama"), nvme(str(tmp_path)), weights=paths["llama", "sharded"]) as engine:
        engine.eval()
        torch.testing.assert_close(logits(engine), logits(refs["llama"]), rtol=0, atol=1e-5)


def test_tied_weight_loads_once_from_either_name(saved, tmp_path):
    """GPT-2's file has transformer.wte.weight only (save_pretrained drops the tied lm_head); a file with only
    lm_head.weight loads the same: the one parameter behind both names."""
    refs, paths = saved
    ref = refs["gpt2"].state_dict()
    renamed = {("lm_head.weight" if k == "transformer.wte.weight" else k): v for k, v in ref.items()
               if k != "lm_head.weight"}
    torch.save(renamed, tmp_path / "head_only.pt")
    for path in (paths["gpt2", "dir"], str(tmp_path / "head_only.pt")):
        model = on_meta("gpt2")
        with infinity.initialize(model, HOST, weights=path) as engine:
            engine.eval()
            assert model.lm_head.weight is model.transformer.wte.weight
            torch.testing.assert_close(logits(engine), logits(refs["gpt2"]), rtol=0, atol=1e-5)


def test_bf16_source_is_cast_to_fp32_masters(tmp_path):
    ref = reference("llama", seed=1)
    ref.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with infinity.initialize(on_meta("llama"), HOST, weights=str(tmp_path / "bf16")) as engine:
        state = engine.full_state_dict()
    for key, value in ref.state_dict().items():
        assert state[key].dtype == torch.float32
        assert torch.equal(state[key], value.float()), key


def swap_files(path) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


@pytest.mark.parametrize("shape, named", [
    ({"layers": 3}, "missing from the file (9): model.layers.2.self_attn.q_proj.weight"),
    ({"layers": 1}, "in the file but not in the model (9): model.layers.1."),
    ({"hidden": 32}, "shapes differ"),
], ids=["missing", "unexpected", "mis-shaped"])
def test_keys_that_do_not_fit_fail_before_any_write(saved, tmp_path, shape, named):
    _, paths = saved
    swap = tmp_path / "swap"
    swap.mkdir()
    with pytest.raises(WeightsError) as err:
        infinity.initialize(on_meta("llama", **shape), nvme(str(swap)), weights=paths["llama", "dir"])
    assert named in str(err.value) and "strict=False" in str(err.value)
    assert swap_files(swap) == [], "nothing is written before the keys are checked"


def test_not_strict_warns_and_initializes_the_missing(saved):
    refs, paths = saved
    ref = refs["llama"].state_dict()
    with pytest.warns(UserWarning, match=r"missing from the file \(9\): model\.layers\.2\."):
        engine = infinity.initialize(on_meta("llama", layers=3), HOST, weights=paths["llama", "dir"], strict=False)
    with engine:
        state = engine.full_state_dict()
    for key, value in state.items():
        if key in ref:
            assert torch.equal(value, ref[key]), key
        elif key.endswith("proj.weight"):
            assert value.abs().sum() > 0, f"{key} keeps its own initialization"


def test_bad_paths_are_named():
    with pytest.raises(WeightsError, match="no such file"):
        infinity.initialize(on_meta("llama"), HOST, weights="/nonexistent/weights")
    with pytest.raises(WeightsError, match="got a list: give a .safetensors file"):
        infinity.initialize(on_meta("llama"), HOST, weights=[])
    with pytest.raises(WeightsError, match="not a state dict of tensors"):
        infinity.initialize(on_meta("llama"), HOST, weights={"lm_head.weight": [0.0]})


def test_peft_model_loads_the_base_checkpoint(saved):
    peft = pytest.importorskip("peft")
    refs, paths = saved
    model = peft.get_peft_model(on_meta("llama"), peft.LoraConfig(r=4, lora_alpha=8,
                                                                 target_modules=["q_proj", "v_proj"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # adapters are not "missing": no warning, no error
        engine = infinity.initialize(model, HOST, weights=paths["llama", "sharded"])
    with engine:
        engine.eval()
        torch.testing.assert_close(logits(engine), logits(refs["llama"]), rtol=0, atol=1e-5)
        state = engine.full_state_dict()
    lora = {k: v for k, v in state.items() if ".lora_" in k}
    assert len(lora) == 8
    for key, value in lora.items():
        assert (value.abs().sum() == 0) == (".lora_B." in key), f"{key}: A as nn.Linear, B zero (PEFT's init)"
    base = refs["llama"].state_dict()
    assert torch.equal(state["base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight"],
                       base["model.layers.1.self_attn.q_proj.weight"])


def load_on_rank(rank, world, path, swap):
    """World size 2: each rank reads only its shards' elements (counted), and the model is whole."""
    from infinity.state import weights
    read = [0]
    original = weights.SafetensorsFiles.read

    def counting(self, key, lo, hi, out, checksum=False):
        read[0] += hi - lo
        return original(self, key, lo, hi, out, checksum)

    weights.SafetensorsFiles.read = counting
    with infinity.initialize(on_meta("llama"), nvme(swap), weights=path) as engine:
        engine.eval()
        return {"logits": logits(engine), "state": engine.full_state_dict(), "read": read[0]}


def test_world_size_two_reads_each_element_once(saved, tmp_path):
    refs, paths = saved
    results = run_distributed(load_on_rank, 2, paths["llama", "sharded"], str(tmp_path))
    ref = refs["llama"]
    for r in results:
        torch.testing.assert_close(r["logits"], logits(ref), rtol=0, atol=1e-5)
    for key, value in ref.state_dict().items():
        assert torch.equal(results[0]["state"][key], value), key
    total = sum(v.numel() for v in ref.state_dict().values())
    assert results[0]["read"] + results[1]["read"] == total, [r["read"] for r in results]
    assert max(r["read"] for r in results) < 0.6 * total
