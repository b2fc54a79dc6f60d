"""Note [peak memory]: the peak RSS `infinity train` predicts (summary.json's "predicted", the estimate of the
run) is within 10% of the peak it measures, for every model source: the built-in GPT, a transformers model of a
given shape, a pretrained Hugging Face directory with its tokenizer, and the same with LoRA. Each run is its own
process (its peak is its own: Note [peak RSS of a spawned process]); the runtime probe imports what the run
imports (models/build.py `runtime_modules`: transformers' modeling code alone is ~160 MiB)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

transformers = pytest.importorskip("transformers")

COMMON = ["run.steps=4", "run.batch_size=4", "run.eval_every=0", "run.eval_batches=1", "model.seq_len=64"]
SHAPE = ["model.n_layer=2", "model.d_model=64", "model.n_head=4"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from hf_tiny import bpe_tokenizer
    path = tmp_path_factory.mktemp("pretrained")
    text = "the stone is grey and the sky is blue; what is two plus two? four. " * 40
    fast = bpe_tokenizer([text])
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    corpus = path.parent / "corpus.txt"
    corpus.write_text(text * 20)
    return path, corpus


def _run(tmp_path, name: str, sets: list[str]) -> tuple[int, int]:
    summary = _summary(tmp_path, name, sets)
    return summary["peak_rss_bytes"], summary["predicted"]["peak_rss_bytes"]


def _summary(tmp_path, name: str, sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "infinity", "train", "--quiet"]
    for s in COMMON + sets + [f"run.dir={tmp_path}", f"run.name={name}"]:
        cmd += ["--set", s]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / name / "summary.json").read_text())


@pytest.fixture(scope="module")
def parquet(tmp_path_factory):
    """A parquet file of 4 KiB texts in row groups of 1,024 (as D29 of benchmarks/RESULTS.md), 16 MiB of text."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    words = [f"w{i % 997} " for i in range(4096)]
    texts = ["".join(words[k % 7:] + words[:k % 7])[:4095] for k in range(4096)]
    file = tmp_path_factory.mktemp("parquet") / "corpus.parquet"
    pq.write_table(pa.table({"text": texts}), file, row_group_size=1024)
    return file


@pytest.mark.parametrize("source", [pytest.param("gpt", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow), "pretrained",  # (~20 s each)
                                    pytest.param("pretrained-lora", marks=pytest.mark.slow),
                                    pytest.param("parquet", marks=pytest.mark.slow)])
def test_the_predicted_peak_is_within_10_percent_for_every_model_source(tmp_path, pretrained, parquet, source):
    """(And the data's source: text records in a parquet file, which the run reads itself; its reader holds ~65 MiB
    beyond pyarrow's import, which the runtime probe reads a sample for: without, 7% under. Planted: the probe not
    reading its sample, the parquet case is under its measured peak.)"""
    path, corpus = pretrained
    sets = {"gpt": SHAPE, "llama": SHAPE + ["model.kind=llama"],
            "pretrained": [f"model.pretrained={path}", f"data.path={corpus}"],
            "pretrained-lora": [f"model.pretrained={path}", f"data.path={corpus}", "model.lora.r=8"],
            "parquet": SHAPE + [f"data.path={parquet}"]}[source]
    measured, predicted = _run(tmp_path, source, sets)
    assert abs(predicted - measured) <= 0.10 * measured, (source, measured >> 20, predicted >> 20)
    if source == "parquet":
        assert predicted >= measured, (measured >> 20, predicted >> 20)


@pytest.mark.parametrize("placement", [["placement.params=host", "placement.grads=host", "placement.optimizer=host"],
                                       []], ids=["host", "job-default"])
def test_a_wide_pretrained_lora_peaks_while_its_weights_load_as_predicted(tmp_path, placement):
    """Note [peak memory]'s init term read from a pretrained directory: a 1536-wide Llama block (37.7M elements in
    bf16 safetensors) fine-tuned with LoRA peaks while a unit is materialized, and a unit read from the file holds
    its fp32 shard and its cast, no full fp32 copy (6 bytes an element, not 10), while its backward fills only
    the adapters' gradient (Note [trainable flat gradient]). The prediction's init term binds (over the training's
    terms) and is within 10% of the measured peak (planted: 10 bytes an element; 0.86x, this fails), the export at
    the end included (a tensor at a time, the heap released after each: docs/estimate.md), from the run's final
    checkpoint; with the job's default placement too, its frozen weights on NVMe (planted: that export without
    the heap release, 1.16x; the job-default case fails)."""
    path = tmp_path / "model"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1536, intermediate_size=6144, num_hidden_layers=1,
                                   num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=128,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    import torch
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    summary = _summary(tmp_path, "wide", [f"model.pretrained={path}", "model.tokenizer=bytes", "model.lora.r=8",
                                          "run.batch_size=1", *placement])
    terms = json.loads((tmp_path / "wide" / "estimate.json").read_text())["peak_terms"]
    training = terms["working_device"] + terms["activations"] + terms["working_host"] + terms["allocator"]
    assert terms["init"] > training, terms
    measured, predicted = summary["peak_rss_bytes"], summary["predicted"]["peak_rss_bytes"]
    assert abs(predicted - measured) <= 0.10 * measured, (measured >> 20, predicted >> 20, terms)


def test_the_summary_sets_measured_beside_predicted(tmp_path):
    """Note [estimate error]: summary.json's "predicted" holds the measured steady step (the median of metrics.jsonl's
    steps 2 on), step 1 and peak RSS beside the predictions, the ratios measured / predicted, and a steady step that
    is the byte model's plus the probe's host time (estimate.json's step_time). Planted: the steady step measured
    as the mean of every step, step 1 included: the median check fails."""
    import statistics
    summary = _summary(tmp_path, "gpt", SHAPE + ["run.steps=6"])
    p, m, r = summary["predicted"], summary["predicted"]["measured"], summary["predicted"]["ratio"]
    steps = {rec["step"]: rec["step_time_s"] for rec in map(json.loads, (tmp_path / "gpt" / "metrics.jsonl")
                                                               .read_text().splitlines())}
    assert sorted(steps) == list(range(1, 7))
    assert m["steady_step_seconds"] == statistics.median_high([steps[s] for s in range(2, 7)])
    assert m["first_step_seconds"] == steps[1] and m["peak_rss_bytes"] == summary["peak_rss_bytes"]
    step_time = json.loads((tmp_path / "gpt" / "estimate.json").read_text())["step_time"]
    assert step_time["host_s"] > 0 and p["host_step_seconds"] == step_time["host_s"]
    assert p["step_seconds"] == pytest.approx(step_time["total_s"] + step_time["host_s"])
    assert p["first_step_seconds"] >= p["step_seconds"]
    assert r["steady_step"] == pytest.approx(m["steady_step_seconds"] / p["step_seconds"])
    assert r["peak_rss"] == pytest.approx(summary["peak_rss_bytes"] / p["peak_rss_bytes"])
    assert r["first_step"] == pytest.approx(steps[1] / p["first_step_seconds"])
