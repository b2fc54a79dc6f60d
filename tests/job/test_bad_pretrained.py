"""Bad pretrained input: `infinity train --set model.pretrained=DIR` exits 2 with one message naming the
problem and the fix, no traceback, for a directory with config but no weights, a truncated safetensors file
and another architecture's weights (run as a user runs it: the CLI in a subprocess)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

from hf_tiny import config, model_class  # noqa: E402


def _save(kind, path):
    cfg = config(kind)
    cfg.vocab_size = 256  # bytes as token ids
    model_class(kind)(cfg).save_pretrained(path)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    _save("llama", root / "good")
    (root / "noweights").mkdir()
    shutil.copy(root / "good" / "config.json", root / "noweights" / "config.json")
    shutil.copytree(root / "good", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    os.truncate(weights, os.path.getsize(weights) // 2)
    shutil.copytree(root / "good", root / "other")  # a GPT-2's weights under a Llama's config
    _save("gpt2", root / "gpt2")
    shutil.copy(root / "gpt2" / "model.safetensors", root / "other" / "model.safetensors")
    assert config("llama").model_type == "llama"
    return root


@pytest.mark.parametrize("case,words", [
    ("noweights", ["holds none of", "model.safetensors"]),
    pytest.param("truncated", ["model.safetensors", "damaged|truncated|does not fit"], marks=pytest.mark.slow),
    pytest.param("other", ["do not fit the model", "missing from the file", "in the file but not in the model"],
                 marks=pytest.mark.slow),  # (the message's parts: tests/state/test_weights.py, in process)
    ("notokenizer", ["no tokenizer in it", "save its tokenizer there", 'model.tokenizer = "bytes"']),
])
def test_bad_pretrained_directory_exits_2_with_one_message(dirs, tmp_path, case, words):
    import re
    env = dict(os.environ, INFINITY_CACHE_DIR=str(tmp_path / "cache"))
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 200)
    cli = [sys.executable, "-m", "infinity.job.cli", "train"]
    # a directory without a tokenizer trains on bytes only when told so (the other cases say it)
    tokenizer = "auto" if case == "notokenizer" else "bytes"
    proc = subprocess.run([*cli, "--set", f"model.pretrained={dirs / case.replace('notokenizer', 'good')}",
                           "--set", f"data.path={corpus}", "--set", f"model.tokenizer={tokenizer}",
                           "--set", "run.steps=1", "--set", f"run.dir={tmp_path}", "--set", "model.seq_len=8",
                           "--set", "run.batch_size=2"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    error = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error) == 1, proc.stderr[-2000:]
    for w in words:
        assert re.search(w, error[0]), (w, error[0])


@pytest.mark.parametrize("targets,ok", [(("all-linear",), True), (("q_proj",), False)])
def test_lora_targets_all_linear_and_hint_with_the_models_own_names(dirs, targets, ok):
    from infinity.config.job import LoraConfig, ModelConfig
    from infinity.config.sections import ConfigError
    from infinity.models.build import build_model
    model = ModelConfig(pretrained=str(dirs / "gpt2"), seq_len=8)
    lora = LoraConfig(r=4, targets=targets)
    if ok:  # every Linear / Conv1D but the head, as PEFT resolves "all-linear"
        adapted = {n.split(".")[-4] for n, _ in build_model(model, lora).model.named_parameters() if "lora_A" in n}
        assert adapted >= {"c_attn", "c_proj", "c_fc"}
    else:
        with pytest.raises(ConfigError, match="c_attn") as e:
            build_model(model, lora)
        assert "v_proj" not in str(e.value)


@pytest.mark.parametrize("tokenizer", ["auto", "bytes"])
def test_a_missing_or_file_pretrained_path_is_named_before_its_files(dirs, tmp_path, tokenizer):
    """model.pretrained that is no directory, or a file in one (its model.safetensors): said as such, not as a
    directory without a tokenizer or a config.json."""
    from infinity.config.sections import ConfigError
    from infinity.job.spec import load_job
    from infinity.job.train import job_batches
    from infinity.models.build import build_model
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 200)
    cases = ((tmp_path / "nope", "': no such directory; give the directory save_pretrained wrote"),
             (dirs / "good" / "model.safetensors", f"' is a file, not a directory: give the directory "
                                                   f"save_pretrained wrote (here probably '{dirs / 'good'}')"))
    for where, needle in cases:
        job = load_job(None, [f"model.pretrained={where}", f"model.tokenizer={tokenizer}", f"data.path={corpus}",
                              "model.seq_len=8", "run.batch_size=2", f"run.dir={tmp_path}"])
        for step in (lambda: job_batches(job), lambda: build_model(job.model, job.lora)):
            with pytest.raises(ConfigError) as e:
                step()
            assert str(e.value).startswith(f"model.pretrained = '{where}{needle}"), e.value
