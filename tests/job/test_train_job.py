"""The `infinity train` job: config resolution, data, run directory, Ctrl-C, torchrun (one node and two)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import infinity
from dist_utils import free_port
from infinity.config.sections import ConfigError
from infinity.data.batches import Batches, load_tokens, split
from infinity.job.spec import TRAIN_DEFAULTS, Job, load_job, to_toml
from infinity.job.train import overlap_efficiency, train
from infinity.models.build import build_model

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0"]



# ---------------------------------------------------------------- config


def test_defaults_put_params_and_optimizer_state_on_nvme_under_the_run_directory():
    job = load_job()
    config = job.engine_config("runs/x")
    assert (config.placement.params, config.placement.grads, config.placement.optimizer) == ("nvme", "host", "nvme")
    assert config.nvme.paths == ("runs/x/swap",)
    assert config.profile.enabled and config.profile.trace_dir == "runs/x/profile"
    assert config.memory.release_heap  # Note [heap release]: the peak summary.json reports is the estimate's
    assert config.optimizer.schedule == "cosine" and config.optimizer.total_steps == job.run.steps
    assert config.optimizer.lr == TRAIN_DEFAULTS["optimizer"]["lr"]


def test_overrides_reach_the_job_and_the_engine():
    job = load_job(None, ["run.steps=7", "optimizer.lr=1e-3", "placement.optimizer=host", "model.kind=llama"])
    config = job.engine_config("s")
    assert job.run.steps == 7 and job.model.kind == "llama"
    assert config.optimizer.lr == 1e-3 and config.placement.optimizer == "host"
    assert config.placement.params == "nvme"  # the job default for the keys not overridden
    assert config.optimizer.total_steps == 7


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_wide_model_from_scratch_gets_a_learning_rate_that_falls_with_its_width(kind):
    """Note [from-scratch lr]: 0.5 / d_model where that is under the job's 2e-3 (GPT-3's table: 6e-4 at 768, 1.2e-4
    at 4096, 1e-4 at 5140; the formula is the reference), the job's lr up to d_model 250, the user's lr always;
    said at the start with its key (planted: the job's lr for every width; the 768 and 4096 cases fail)."""
    def lr(*sets):
        job = load_job(None, [f"model.kind={kind}", *sets])
        return job.engine_config("s").optimizer.lr, [d.line() for d in job.defaults()]
    assert lr("model.d_model=128", "model.n_head=4") == (2e-3, [])  # the default model: the job's lr
    assert lr("model.d_model=248", "model.n_head=4")[0] == 2e-3
    for width, want in ((768, 6.5e-4), (4096, 1.2e-4), (5120, 9.8e-5)):
        got, lines = lr(f"model.d_model={width}", "model.n_head=8")
        assert got == pytest.approx(0.5 / width, rel=0.03) and got == want, (width, got)  # (two digits)
        assert lines == [f"from-scratch default: optimizer.lr = {want} (a model trained from scratch at d_model = "
                         f"{width}: 0.5 / d_model, the job's 0.002 being for narrower ones; --set optimizer.lr=... "
                         "to change it)"]
    assert lr("model.d_model=4096", "model.n_head=8", "optimizer.lr=1e-3") == (1e-3, [])  # the user's, unsaid


def test_auto_policy_and_constant_schedule_drop_the_job_defaults_they_contradict():
    config = load_job(None, ["placement.policy=auto", "optimizer.schedule=constant"]).engine_config("s")
    assert config.placement.policy == "auto" and config.placement.params == "device"  # the engine default
    assert config.optimizer.schedule == "constant" and config.optimizer.total_steps == 0


@pytest.mark.parametrize("overrides,needle", [
    (["run.stepz=3"], 'run.stepz (did you mean "steps"?)'),
    (["model.kind=gpt3"], 'model.kind = "gpt3": not a valid choice'),
    (["modle.n_layer=2"], 'unknown section [modle] (did you mean "model"?)'),
    (["model.n_head=5"], "model.n_head = 5: must divide model.d_model"),
    (["model.vocab_size=100"], "model.vocab_size = 100: must be >= 256"),
    (["data.val_fraction=0.9"], "data.val_fraction = 0.9: must be < 0.5"),
    (["placement.params=disk"], 'placement.params = "disk"'),
    (["model.n_kv_head=2"], 'only llama has grouped-query attention; remove it or set model.kind = "llama"'),
    (["run.name=../elsewhere"], "run.name = \"../elsewhere\": the name of one directory under run.dir"),  # was
    (["run.name=a/b"], "without '/'"),  # created outside run.dir, or an error naming run.dir
])
def test_bad_job_keys_name_the_key_and_the_fix(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_job(None, overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("text,needle", [
    # a key above the first [section] line: where it belongs, not "unknown section [steps]"
    ("steps = 3\n[run]\nbatch_size = 2\n", "steps = 3 is a key outside any section (above the first [section] "
                                             "line); it is a key of [run]: write it under [run]"),
    ("lr = 1e-3\n", "it is a key of [optimizer]: write it under [optimizer]"),
    ("stepz = 3\n", "no section has a key 'stepz'"),
    # the sub-table given as a key: how to write the table
    ("[model]\nlora = 4\n", "model.lora is a table, not a key: write [model.lora] on its own line, then its "
                             "keys, e.g. r = 4"),
    ("[model]\nlorra = 4\n", "valid keys of [model]: pretrained, kind, n_layer, d_model, n_head, n_kv_head, "
                              "ffn_dim, tokenizer, seq_len, vocab_size, and the table [model.lora]"),
])
def test_misplaced_keys_in_a_job_file_say_where_they_belong(tmp_path, text, needle):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_job(path)
    assert needle in str(e.value)


def test_the_job_sections_are_the_ones_the_engine_config_names():
    """Config.from_file names a job file by JOB_FILE_SECTIONS: the job's own sections (and their tables)."""
    from infinity.config.job import JOB_SECTIONS
    from infinity.config.sections import JOB_FILE_SECTIONS
    assert set(JOB_FILE_SECTIONS) == {name.split(".")[0] for name in JOB_SECTIONS}


def test_resolved_config_round_trips_through_toml(tmp_path):
    job = load_job(None, ["run.steps=9", "precision.compute_dtype=bf16"])
    config = job.engine_config(str(tmp_path))
    path = tmp_path / "config.toml"
    path.write_text(to_toml(config, job, str(tmp_path)))
    again = load_job(path)
    assert again.engine_config(str(tmp_path)) == config
    assert (again.run, again.model, again.data) == (job.run, job.model, job.data)


# ---------------------------------------------------------------- data


def test_shipped_corpus_is_a_few_megabytes_of_text():
    tokens = load_tokens("kjv")
    assert 1_000_000 < len(tokens) < 8_000_000
    text = bytes(tokens[:200].tolist()).decode()
    assert "In the beginning God created the heaven and the earth." in text


def test_every_world_size_sees_the_same_global_batches():
    tokens = torch.arange(10_000) % 251
    train_part, val_part = split(tokens.to(torch.uint8), 0.1, 16)
    whole = Batches(train_part, val_part, seq_len=16, global_batch=8, seed=3)
    for world in (2, 4):
        rows = [Batches(train_part, val_part, seq_len=16, global_batch=8, seed=3, rank=r, world=world).batch(5, 1)
                for r in range(world)]
        x, y = whole.batch(5, 1)
        torch.testing.assert_close(torch.cat([r[0] for r in rows]), x)
        torch.testing.assert_close(torch.cat([r[1] for r in rows]), y)
    torch.testing.assert_close(y[:, :-1], x[:, 1:])  # targets are the next bytes
    assert not torch.equal(whole.batch(5, 0)[0], whole.batch(6, 0)[0])
    with pytest.raises(ConfigError, match="multiple of 3"):
        Batches(train_part, val_part, seq_len=16, global_batch=8, seed=3, rank=0, world=3)


def test_missing_corpus_file_is_explained():
    with pytest.raises(ConfigError, match="no such file"):
        load_tokens("/nonexistent/corpus.txt")


# ---------------------------------------------------------------- the run


def reference_losses(job: Job, steps: int) -> list[float]:
    """Plain PyTorch with torch.optim.AdamW on the same model, init, batches and schedule."""
    from infinity.models.gpt import GPT, GPTConfig
    from infinity.optim.schedule import lr_at
    config = job.engine_config("unused")
    m = job.model
    with infinity.meta_init():
        model = GPT(GPTConfig(vocab_size=m.vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                              d_model=m.d_model))
    engine = infinity.initialize(model, {"train": {"seed": config.train.seed}}, init_fn=__import__(
        "infinity.models.gpt", fromlist=["gpt_init"]).gpt_init)
    state = engine.full_state_dict()
    engine.close()
    ref = GPT(GPTConfig(vocab_size=m.vocab_size, seq_len=m.seq_len, n_layer=m.n_layer, n_head=m.n_head,
                        d_model=m.d_model))
    ref.load_state_dict(state)
    o = config.optimizer
    opt = torch.optim.AdamW(ref.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    batches = Batches.from_config(job.data, seq_len=m.seq_len, global_batch=job.run.batch_size)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        x, y = batches.batch(step, 0)
        loss = ref(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), o.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_run_directory_and_losses_match_plain_pytorch(tmp_path):
    steps = 6
    job = load_job(None, TINY + [f"run.steps={steps}", f"run.dir={tmp_path}", "run.name=r", "run.eval_every=3"])
    result = train(job, verbose=False)
    run = tmp_path / "r"
    assert result.status == "completed" and result.steps == steps
    assert {"config.toml", "metrics.jsonl", "memory_report.json", "summary.json", "estimate.json", "profile"} <= {
        p.name for p in run.iterdir()}
    assert (run / "profile" / "rank0" / "summary.json").exists() and (run / "profile" / "rank0" / "trace.json").exists()
    assert not (run / "swap").exists(), "swap files are removed at the end"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "overlap_efficiency"} <= set(records[0])
    assert 0 < records[-1]["overlap_efficiency"] <= 1
    assert [r for r in records if "val_loss" in r][0]["step"] == 3
    torch.testing.assert_close(torch.tensor([r["loss"] for r in records]), torch.tensor(reference_losses(job, steps)))
    report = json.loads((run / "memory_report.json").read_text())
    assert report["state"] == report["plan"] and report["state"]["nvme"]["master"] > 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] and summary["peak_rss_bytes"] > 0
    assert load_job(run / "config.toml").engine_config("x").placement == job.engine_config("x").placement
    with pytest.raises(ConfigError, match="already holds a run"):
        train(job, verbose=False)


def test_skipped_steps_are_marked_and_the_lr_is_the_applied_updates(tmp_path):
    """fp16 steps that overflow are skipped: metrics.jsonl marks them, its lr is the schedule's at the count of
    updates applied before (the engine's schedule skips them too, as HF's does), and the profile numbers every
    step as metrics.jsonl does."""
    from infinity.optim.schedule import lr_at
    job = load_job(None, TINY + ["run.steps=6", f"run.dir={tmp_path}", "run.name=r", "precision.compute_dtype=fp16",
                                 "precision.initial_loss_scale=1048576", "optimizer.warmup_steps=4"])
    train(job, verbose=False)
    records = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    skipped = [not math.isfinite(r["grad_norm"]) for r in records]
    assert 0 < sum(skipped) < len(records) and [r.get("skipped", False) for r in records] == skipped
    cfg = job.engine_config(str(tmp_path / "r")).optimizer
    assert [r["lr"] for r in records] == [lr_at(sum(not s for s in skipped[:i]), cfg) for i in range(len(records))]
    profile = json.loads((tmp_path / "r" / "profile" / "rank0" / "summary.json").read_text())
    assert [s["step"] for s in profile["steps"]] == [r["step"] for r in records]


def test_overlap_efficiency_shows_when_a_profiler_reports_it():
    class Engine:
        pass
    engine = Engine()
    assert overlap_efficiency(engine) is None
    engine.profiler = type("P", (), {"summary": lambda self: {"steps": [{"overlap_efficiency": 0.8}],
                                                             "median": {"overlap_efficiency": 0.7}}})()
    assert overlap_efficiency(engine) == 0.8


def _metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ctrl_c_stops_cleanly_after_the_current_step(tmp_path):
    cmd = [sys.executable, "-m", "infinity", "train", "--quiet"] + [a for o in TINY + [
        "run.steps=100000", f"run.dir={tmp_path}", "run.name=r"] for a in ("--set", o)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "r" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, proc.stderr.read()
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and 3 <= summary["steps"] < 100000
    assert len(_metrics(tmp_path / "r")) == summary["steps"]
    assert (tmp_path / "r" / "memory_report.json").exists() and not (tmp_path / "r" / "swap").exists()


def _torchrun(args: list[str], overrides: list[str], env) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", *args, "-m", "infinity", "train", "--quiet"]
    return subprocess.Popen(cmd + [a for o in overrides for a in ("--set", o)], env=env, stderr=subprocess.PIPE,
                            text=True)


@pytest.mark.slow  # (21 s: the suite's 8 minutes; the engine at world 2 and 3 is tested in process groups throughout)
def test_two_nodes_train_like_one_node_with_two_processes(tmp_path):
    """torchrun --nnodes 2 (rendezvous on 127.0.0.1) and --nproc-per-node 2 give the same losses."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the same kernels, so the same floating-point sums
    common = TINY + ["run.steps=4", f"run.dir={tmp_path}", "run.eval_every=2"]
    one = _torchrun(["--nproc-per-node", "2", "--standalone"], common + ["run.name=one"], env)
    assert one.wait(timeout=180) == 0, one.stderr.read()
    endpoint = f"127.0.0.1:{free_port()}"  # both nodes must be told it
    nodes = [_torchrun(["--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", endpoint, "--rdzv-id", "infinity-test"], common + ["run.name=two"], env)
             for r in range(2)]
    for node in nodes:
        assert node.wait(timeout=180) == 0, node.stderr.read()
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in a] == [r[key] for r in b], key
    assert [r.get("val_loss") for r in a] == [r.get("val_loss") for r in b]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and math.isfinite(summary["last_loss"])


@pytest.mark.slow
def test_default_train_finishes_in_5_minutes_with_the_loss_falling(tmp_path):
    start = time.time()
    out = subprocess.run([sys.executable, "-m", "infinity", "train", "--quiet", "--set", f"run.dir={tmp_path}",
                          "--set", "run.name=default"], capture_output=True, text=True, timeout=600)
    elapsed = time.time() - start
    assert out.returncode == 0, out.stderr
    assert elapsed < 300, elapsed
    losses = [r["loss"] for r in _metrics(tmp_path / "default")]
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
    summary = json.loads((tmp_path / "default" / "summary.json").read_text())
    measured, predicted = summary["peak_rss_bytes"], summary["predicted"]["peak_rss_bytes"]
    assert abs(predicted - measured) <= 0.15 * measured, (predicted >> 20, measured >> 20)  # Note [heap release]


@pytest.mark.parametrize("overrides,needle", [
    (["run.export_dtype=bf16"], "run.export_dtype = \"bf16\" has no effect without model.pretrained"),
    (["run.export=false"], "run.export = false has no effect without model.pretrained"),
])
def test_export_keys_without_a_pretrained_model_are_refused(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_job(None, overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("fmt,overrides,needle", [
    ("text", ["data.packing=true"], 'data.packing = true has no effect with data.format = "text"'),
    ("text", ["data.truncation=refuse"], 'data.truncation = "refuse" has no effect'),
    ("text", ["data.train_on_prompt=true", "data.messages_field=x"],
     "remove data.messages_field, data.train_on_prompt"),
    ("text", ["data.val_path=v.txt"], "data.val_path = "),
    ("completion", ["data.messages_field=conv"], 'data.messages_field = "conv" has no effect with data.format = "c'),
    ("chat", ["data.prompt_field=q"], 'data.prompt_field = "q" has no effect with data.format = "chat"'),
    ("chat", ["data.val_path=v.jsonl", "data.val_fraction=0.2"], "data.val_fraction = 0.2 has no effect"),
])
def test_data_keys_the_format_does_not_read_are_refused(fmt, overrides, needle, tmp_path):
    """Note [no silent keys]: each was accepted and did nothing (text ignores every record key and val_path)."""
    from infinity.data.tokenized import resolve_data_format
    job = load_job(None, [f"data.format={fmt}", *overrides])
    with pytest.raises(ConfigError) as e:
        resolve_data_format(job)
    assert needle in str(e.value)


def test_a_checkpoint_dir_the_job_would_not_save_under_is_refused(tmp_path):
    """Note [no silent keys]: infinity train saves its checkpoints in the run directory (where --resume finds
    them); checkpoint.dir moved only preflight's space check, so a user's other disk was checked and unused."""
    job = load_job(None, TINY + ["run.steps=1", f"run.dir={tmp_path}", "run.name=r",
                                 f"checkpoint.dir={tmp_path / 'elsewhere'}"])
    with pytest.raises(ConfigError, match=r"checkpoint.dir = .*elsewhere.*: infinity train saves its checkpoints in "
                                          r"the run directory .*remove checkpoint.dir, and to put the run on another "
                                          r"disk set run.dir there"):
        train(job, verbose=False)
    assert not (tmp_path / "r").exists()


def test_on_a_gpu_the_job_leaves_auto_tail_units_the_traced_activations():
    """Note [tail units]: on a GPU `infinity train` traces the micro-batch's activations before initialize and sets
    memory.activation_reserve to them, so "auto" tail units plan within what they leave (the engine alone keeps
    half the free memory for them); equal to what `infinity estimate` traces for the run. Not on a CPU (no tail
    units there), not over a size the user set, not without "auto" tail units; the run's config.toml keeps "auto"."""
    from infinity.job.prediction import reserve_activations
    from infinity.plan import estimate as est
    offload = ["placement.params=device", "placement.grads=host", "placement.optimizer=host"]
    job = load_job(None, TINY + offload)
    config = job.engine_config("x")
    assert reserve_activations(job, config, 1, cuda=False) is config
    reserved = reserve_activations(job, config, 1, cuda=True)
    traced = est.estimate(lambda: build_model(job.model, job.lora), config, batch_size=job.run.batch_size,
                          seq_len=job.model.seq_len, cuda=False)
    assert reserved.memory.activation_reserve == est.activation_bytes(traced.trace, config.activation)["device"] > 0
    assert dataclasses.replace(reserved, memory=config.memory) == config  # (nothing else changed)
    wide = load_job(None, TINY + offload + ["run.batch_size=8"])
    wider = reserve_activations(wide, wide.engine_config("x"), 1, cuda=True)
    assert wider.memory.activation_reserve > reserved.memory.activation_reserve  # (per micro-batch: it grows)
    for other in (["memory.activation_reserve=1MiB"], ["placement.tail_units=0"]):
        own = load_job(None, TINY + offload + other).engine_config("x")
        assert reserve_activations(load_job(None, TINY + offload + other), own, 1, cuda=True) is own


def test_a_warmup_longer_than_the_run_is_warned():
    """optimizer.warmup_steps = 50 in a 2-step run: the job made total_steps 51 and the learning rate never left
    the warmup (2/50 of lr at the end), without a word. Now a SettingWarning (the command prints it as one line:
    Note [inert setting]); the default warmup (min(20, steps / 10)) and a warmup as long as the run are quiet."""
    import warnings as w

    from infinity.config.sections import SettingWarning
    from infinity.optim.schedule import lr_at
    with pytest.warns(SettingWarning, match=r"warmup_steps = 50 is more than run.steps = 2: .* never reaches"):
        config = load_job(None, TINY + ["run.steps=2", "optimizer.warmup_steps=50"]).engine_config("x")
    assert lr_at(1, config.optimizer) < config.optimizer.lr / 10  # (what it warns about: the run's last lr)
    with w.catch_warnings():
        w.simplefilter("error", SettingWarning)
        load_job(None, TINY + ["run.steps=2"]).engine_config("x")
        load_job(None, TINY + ["run.steps=2", "optimizer.warmup_steps=2"]).engine_config("x")


def test_activations_that_cannot_be_traced_leave_the_engines_rule_and_say_so(monkeypatch):
    """A model the estimator cannot trace must not stop `infinity train` on a GPU: the engine's half rule
    (Note [tail units]) and a SettingWarning naming the error and the two settings that decide instead."""
    from infinity.config.sections import SettingWarning
    from infinity.job.prediction import reserve_activations
    from infinity.plan import estimate as est

    def untraceable(*args, **kwargs):
        raise NotImplementedError("an operator the trace does not know")
    monkeypatch.setattr(est, "traced_activations", untraceable)
    job = load_job(None, TINY + ["placement.params=device", "placement.grads=host", "placement.optimizer=host"])
    config = job.engine_config("x")
    with pytest.warns(SettingWarning, match=r"could not be traced \(NotImplementedError: an operator .*"
                                            r"memory.activation_reserve"):
        assert reserve_activations(job, config, 1, cuda=True) is config


@pytest.mark.gpu
def test_gpu_the_job_plans_auto_tail_units_beside_its_traced_activations(tmp_path, monkeypatch):
    """On a GPU, `infinity train` hands initialize the traced activations (reserve_activations), and the engine's
    tail units are planned in what they leave: the plan says so; the run trains (Note [tail units])."""
    seen = {}
    real = infinity.initialize

    def initialize(model, config, **kw):
        seen["engine"] = engine = real(model, config, **kw)
        return engine
    monkeypatch.setattr(infinity, "initialize", initialize)
    job = load_job(None, TINY + ["run.steps=2", f"run.dir={tmp_path}", "run.name=r", "placement.params=device",
                                 "placement.grads=host", "placement.optimizer=host"])
    assert train(job, verbose=False).status == "completed"
    engine = seen["engine"]
    assert engine.config.memory.activation_reserve > 0
    said = [r for r in engine.plan.reasons if r.startswith("tail units:")]
    assert said and "left for the activations" in said[0] and "not traced" not in said[0], engine.plan.reasons


def test_the_runs_own_estimate_plans_with_the_machine_it_started_on(tmp_path, monkeypatch):
    """Note [estimate error]: summary.json's prediction is made after training, when the run's own swap files
    take their share of the disk. On a faked disk (100 GiB, 10 GiB of memory.headroom) whose free space is what
    was free at the start less what the run's swap directory holds, with room at the start for the swap and half
    of it again: with the budgets of the run's start the summary has its predicted peak RSS and step (planted:
    the budgets resolved at the end, when the disk is short of the swap: no plan, no prediction; this fails)."""
    import shutil
    from types import SimpleNamespace

    from infinity.job import cli
    sets = ["run.steps=3", "run.checkpoint=false", "run.eval_every=0", f"run.dir={tmp_path}", "run.name=r",
            "model.n_layer=2", "model.d_model=64", "model.n_head=4", "model.seq_len=32", "run.batch_size=2"]
    args = cli.build_parser().parse_args(["estimate", *[a for s in sets for a in ("--set", s)]])
    swap = sum(cli._job_estimate(args, cli._line(args), None).state()["nvme"].values())
    assert swap > 0, "the case needs state on the disk"
    start_free = 10 * (1 << 30) + swap * 3 // 2
    real = shutil.disk_usage

    def held(root) -> int:
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)

    def disk_usage(path):
        if not str(path).startswith(str(tmp_path)):
            return real(path)
        return SimpleNamespace(total=100 << 30, used=0, free=start_free - held(tmp_path / "r" / "swap"))
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    train(load_job(None, sets), verbose=False)  # (its swap directory is removed after the summary)
    predicted = json.loads((tmp_path / "r" / "summary.json").read_text())["predicted"]
    assert predicted["peak_rss_bytes"] and predicted["step_seconds"], predicted
