"""Exports that stand alone (Note [stand-alone export]): the weights in the source's dtype or the one asked
for, config.json saying it, the pretrained directory's tokenizer files (chat template included), and nothing
left beside the directory. The reference is transformers itself: from_pretrained / AutoTokenizer of the
export, and the engine's own fp32 weights cast with torch."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

import infinity  # noqa: E402
from hf_tiny import HOST, logits, model_class, on_meta, reference, train  # noqa: E402

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("standalone") / "llama"
    reference("llama").save_pretrained(root)
    return root


def _trained_export(llama, out, **kw):
    with infinity.initialize(on_meta("llama"), HOST, weights=str(llama)) as engine:
        train(engine)
        engine.eval()
        want = logits(engine)
        engine.export_state_dict(str(out), **kw)
    return want


def test_api_directory_export_loads_alone_and_leaves_nothing_beside(llama, tmp_path):
    out = tmp_path / "hf"
    want = _trained_export(llama, out)
    assert os.listdir(tmp_path) == ["hf"], "no checkpoint left beside the export"
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors"] or \
        sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    back = model_class("llama").from_pretrained(out).eval()  # no config saved by hand: the export has it
    torch.testing.assert_close(logits(back), want, rtol=0, atol=1e-5)
    fp32 = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float32 for t in fp32.values()), "auto: the model config's dtype (fp32 here)"
    _trained_export(llama, out, dtype="bf16")  # exporting twice into the same path works
    assert os.listdir(tmp_path) == ["hf"]
    bf16 = load_file(str(out / "model.safetensors"))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for key, t in bf16.items():  # the same training (seeded) cast once, as torch casts it
        assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[key].to(torch.bfloat16)), key


def _pretrained_bf16(root):
    """A tiny Llama saved in bf16 with a tokenizer that has a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    model = reference("llama").to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(root)
    words = "in the beginning god created heaven and earth hi <|e|> <unk>".split()
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|e|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(root)
    return root


@pytest.mark.slow  # two short fine-tuning jobs: about 40 s each on 2 cores
@pytest.mark.parametrize("export_dtype,want", [("auto", torch.bfloat16), ("fp32", torch.float32)])
def test_job_export_is_in_the_source_dtype_with_its_tokenizer_and_chat_template(tmp_path, export_dtype, want):
    from infinity.job.spec import load_job
    from infinity.job.train import train as train_job
    from infinity.models.build import build_model
    src = _pretrained_bf16(tmp_path / "src")
    assert "chat_template.jinja" in os.listdir(src)
    corpus = tmp_path / "c.txt"
    corpus.write_text("in the beginning god created the heaven and the earth\n" * 400)
    job = load_job(None, ["model.seq_len=16", "run.batch_size=2", "run.eval_every=0", "run.eval_batches=1",
                          "run.steps=2", f"model.pretrained={src}", f"run.dir={tmp_path}", "run.name=r",
                          f"data.path={corpus}", f"run.export_dtype={export_dtype}"])
    assert train_job(job, verbose=False).status == "completed"
    out = tmp_path / "r" / "export"
    assert {"config.json", "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    assert not (tmp_path / "r" / "export.export-tmp").exists()
    weights = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {want}
    assert json.loads((out / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == TEMPLATE
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|user|>hi\n"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == want
    x = torch.tensor([tokenizer("in the beginning god")["input_ids"]])
    bundle = build_model(job.model, job.lora)
    groups = {**HOST, "optimizer": {**HOST.get("optimizer", {}),
                                    "no_decay": list(job.engine_config("r").optimizer.no_decay)}}
    engine = infinity.initialize(bundle.model, groups, weights=bundle.weights)  # the job's parameter groups
    with engine, torch.no_grad():
        engine.load_checkpoint(str(tmp_path / "r" / "checkpoint"))
        engine.eval()
        ref = engine(input_ids=x).logits
    torch.testing.assert_close(loaded(input_ids=x).logits.float(),
                               model_class("llama").from_pretrained(out, dtype=want)(input_ids=x).logits.float())
    if want == torch.float32:
        torch.testing.assert_close(loaded(input_ids=x).logits, ref.float(), rtol=0, atol=1e-5)
