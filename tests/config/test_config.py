"""Config loading, normalization and the errors users see for bad input."""

import tomllib

import pytest

from infinity.config.sections import Config, ConfigError, format_size, parse_size

GiB = 2**30

# (config dict, overrides, dotted key the message must name, fix hint it must contain)
BAD = [
    # typos in names
    ({"optimzer": {"lr": 1e-3}}, [], "[optimzer]", 'did you mean "optimizer"'),
    ({"optimizer": {"learning_rate": 1e-3}}, [], "optimizer.learning_rate", "valid keys of [optimizer]"),
    ({"optimizer": {"weight_decy": 0.1}}, [], "optimizer.weight_decy", 'did you mean "weight_decay"'),
    ({"train": {"lr": 1e-3}}, [], "train.lr", 'did you mean "optimizer.lr"'),
    ({"lr": 1e-3}, [], "lr = 0.001 is a key outside any section", "write it under [optimizer]"),
    ({"placement": {"param": "host"}}, [], "placement.param", 'did you mean "params"'),
    ({}, ["optimizer.betass=[0.9, 0.99]"], "optimizer.betass", 'did you mean "betas"'),
    ({}, ["optimizer"], "override 'optimizer'", "section.key=value"),
    ({}, ["lr=1e-3"], "override 'lr=1e-3'", "section.key"),
    # wrong types
    ({"optimizer": 3}, [], "[optimizer]", "must be a table"),
    ({"optimizer": {"lr": "fast"}}, [], "optimizer.lr", "expected a number"),
    ({"optimizer": {"lr": True}}, [], "optimizer.lr", "expected a number"),
    ({"train": {"grad_accum_steps": 1.5}}, [], "train.grad_accum_steps", "whole number"),
    ({"train": {"seed": True}}, [], "train.seed", "whole number"),
    ({"train": {"grad_accum_steps": 2.0}}, [], "train.grad_accum_steps", "whole number"),
    ({"io": {"direct": "yes"}}, [], "io.direct", "true or false"),
    ({"io": {"checksum": 1}}, [], "io.checksum", "not a valid choice"),
    ({"io": {"checksum": True}}, [], "io.checksum", '"full" | "sampled" | "off"'),
    ({"optimizer": {"betas": 0.9}}, [], "optimizer.betas", "expected a list"),
    ({"optimizer": {"betas": [0.9]}}, [], "optimizer.betas", "exactly 2 values"),
    ({"optimizer": {"betas": [0.9, "0.95"]}}, [], "optimizer.betas[1]", "expected a number"),
    ({"nvme": {"paths": "/mnt/nvme0"}}, [], "nvme.paths", "expected a list"),
    ({"nvme": {"paths": [""]}}, [], "nvme.paths[0]", "non-empty string"),
    ({"units": {"classes": [3]}}, [], "units.classes[0]", "non-empty string"),
    ({"profile": {"trace_dir": ""}}, [], "profile.trace_dir", "non-empty string"),
    # out of range
    ({"optimizer": {"lr": 0}}, [], "optimizer.lr", "must be > 0"),
    ({"optimizer": {"lr": float("nan")}}, [], "optimizer.lr", "finite"),
    ({}, ["optimizer.lr=inf"], "optimizer.lr", "finite"),
    ({"optimizer": {"eps": -1e-8}}, [], "optimizer.eps", "must be > 0"),
    ({"optimizer": {"weight_decay": -0.1}}, [], "optimizer.weight_decay", "must be >= 0"),
    ({"optimizer": {"grad_clip": -1.0}}, [], "optimizer.grad_clip", "must be >= 0"),
    ({"optimizer": {"betas": [0.9, 1.0]}}, [], "optimizer.betas[1]", "must be < 1"),
    ({"optimizer": {"betas": [-0.1, 0.95]}}, [], "optimizer.betas[0]", "must be >= 0"),
    ({"optimizer": {"warmup_steps": -5}}, [], "optimizer.warmup_steps", "must be >= 0"),
    ({"optimizer": {"sub_group_size": 0}}, [], "optimizer.sub_group_size", "must be > 0"),
    ({"optimizer": {"schedule": "cosine", "total_steps": 10, "min_lr_ratio": 1.5}}, [], "optimizer.min_lr_ratio",
     "must be <= 1"),
    ({"train": {"grad_accum_steps": 0}}, [], "train.grad_accum_steps", "must be >= 1"),
    ({"train": {"seed": -1}}, [], "train.seed", "must be >= 0"),
    ({"io": {"queue_depth": 0}}, [], "io.queue_depth", "must be >= 1"),
    ({"io": {"threads": 0}}, [], "io.threads", "must be >= 1"),
    ({"prefetch": {"units_ahead": -1}}, [], "prefetch.units_ahead", "must be >= 0"),
    ({"precision": {"compute_dtype": "fp16", "initial_loss_scale": 0}}, [], "precision.initial_loss_scale",
     "must be > 0"),
    # sizes
    ({"io": {"block_size": "12 GiBs"}}, [], "io.block_size", 'did you mean "GiB"'),
    ({"memory": {"host_budget": "-1GiB"}}, [], "memory.host_budget", "must be >= 0"),
    ({"memory": {"host_budget": -5}}, [], "memory.host_budget", "must be >= 0"),
    ({"memory": {"device_budget": "lots"}}, [], "memory.device_budget", "e.g. \"1MiB\""),
    ({"memory": {"device_budget": "Auto"}}, [], "memory.device_budget", 'write "auto" in lower case'),
    ({"memory": {"host_budget": 0}}, [], "memory.host_budget", "must be > 0"),
    ({"memory": {"host_budget": "0.1B"}}, [], "memory.host_budget", "whole number of bytes"),
    ({"prefetch": {"max_bytes_in_flight": "0GiB"}}, [], "prefetch.max_bytes_in_flight", "must be > 0"),
    ({"io": {"block_size": "1KiB"}}, [], "io.block_size", "must be >= 4096"),
    ({"io": {"block_size": "5000"}}, [], "io.block_size", 'power of two, e.g. "4KiB" or "8KiB"'),
    ({"io": {"block_size": True}}, [], "io.block_size", "expected a size"),
    # enums
    ({"optimizer": {"name": "AdamW"}}, [], "optimizer.name", 'did you mean "adamw"'),
    ({"optimizer": {"name": "sgd"}}, [], "optimizer.name", 'valid: "adam" | "adamw"'),
    ({"optimizer": {"schedule": "cosine_decay"}}, [], "optimizer.schedule", 'did you mean "cosine"'),
    ({"precision": {"compute_dtype": "bfloat16"}}, [], "precision.compute_dtype", '"fp32" | "bf16" | "fp16"'),
    ({}, ["placement.params=disk"], "placement.params", '"device" | "host" | "nvme"'),
    ({"placement": {"policy": "dynamic"}}, [], "placement.policy", '"static" | "auto"'),
    ({"train": {"on_nonfinite": "ignore"}}, [], "train.on_nonfinite", '"error" | "skip"'),
    # contradictions
    ({"placement": {"optimizer": "nvme"}}, [], "placement.optimizer", 'set nvme.paths = ["/path/to/fast/disk"]'),
    ({}, ["placement.params=nvme"], "placement.params", "set nvme.paths"),
    ({"nvme": {"paths": ["/mnt/a", "/mnt/a"]}}, [], "nvme.paths", "list each once"),
    ({"units": {"classes": ["Block", "Block"]}}, [], "units.classes", "list each once"),
    ({"optimizer": {"schedule": "cosine", "warmup_steps": 100, "total_steps": 100}}, [], "optimizer.total_steps",
     "must be > optimizer.warmup_steps"),
    ({"optimizer": {"schedule": "linear"}}, [], "optimizer.total_steps", "set total_steps"),
    ({"optimizer": {"min_lr_ratio": 0.1}}, [], "optimizer.min_lr_ratio", 'set optimizer.schedule = "cosine"'),
    ({"optimizer": {"total_steps": 1000}}, [], "optimizer.total_steps", "remove it"),
    ({"precision": {"initial_loss_scale": 1024.0}}, [], "precision.initial_loss_scale",
     'set precision.compute_dtype = "fp16"'),
    ({"precision": {"compute_dtype": "bf16", "loss_scale_growth_interval": 10}}, [],
     "precision.loss_scale_growth_interval", 'compute_dtype = "fp16"'),
    ({"placement": {"policy": "auto", "params": "host"}}, [], "placement.params", 'set placement.policy = "static"'),
]


@pytest.mark.parametrize("data, overrides, key, hint", BAD, ids=[f"{i}-{case[2]}" for i, case in enumerate(BAD)])
def test_bad_config_names_key_and_fix(data, overrides, key, hint):
    with pytest.raises(ConfigError) as info:
        Config.from_dict(data, overrides=overrides)
    message = str(info.value)
    assert key in message, message
    assert hint in message, message
    assert isinstance(info.value, ValueError)


def test_defaults():
    config = Config()
    assert config.optimizer.name == "adamw" and config.optimizer.lr == 3e-4
    assert config.optimizer.betas == (0.9, 0.95)
    assert config.placement.params == "device" and config.memory.host_budget == "auto"
    assert config.nvme.paths == () and config.units.classes == ()
    assert config.io.block_size == 2**20 and config.prefetch.max_bytes_in_flight == 4 * GiB
    assert config.overlap.optimizer_with_backward is True and config.train.grad_accum_steps == 1
    assert config.profile.enabled is False and config.precision.compute_dtype == "fp32"
    assert Config.from_dict({}) == config


def test_from_file_round_trip(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        """
[optimizer]
name = "adam"
lr = 1
betas = [0.8, 0.99]
weight_decay = 0.1
schedule = "cosine"
warmup_steps = 10
total_steps = 1000
[precision]
compute_dtype = "fp16"
initial_loss_scale = 1024
[placement]
params = "nvme"
optimizer = "nvme"
grads = "host"
[memory]
device_budget = "70GiB"
host_budget = "12 GB"
[nvme]
paths = ["/mnt/nvme0", "/mnt/nvme1"]
[io]
block_size = "4MiB"
direct = false
[units]
classes = ["Block"]
"""
    )
    config = Config.from_file(path)
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.optimizer.betas == (0.8, 0.99)
    assert config.precision.initial_loss_scale == 1024.0
    assert config.memory.device_budget == 70 * GiB and config.memory.host_budget == 12 * 10**9
    assert config.nvme.paths == ("/mnt/nvme0", "/mnt/nvme1")
    assert config.io.block_size == 4 * 2**20 and config.io.direct is False
    assert Config.from_dict(config.to_dict()) == config
    assert config.to_dict()["memory"]["device_budget"] == 70 * GiB


def test_from_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nlr = \n")
    with pytest.raises(ConfigError, match="bad.toml: invalid TOML"):
        Config.from_file(path)
    path.write_text("[optimizer]\nlrr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"bad.toml: unknown key optimizer.lrr \(did you mean \"lr\"\?\)"):
        Config.from_file(path)


def test_from_file_names_a_missing_file_a_job_file_and_a_key_outside_sections(tmp_path):
    with pytest.raises(ConfigError, match=r"config file .*nope.toml: cannot read it \(No such file or directory\); "
                                          r"give the path of a TOML file"):
        Config.from_file(tmp_path / "nope.toml")
    path = tmp_path / "config.toml"  # what `infinity train` writes in a run directory: a job file
    path.write_text("[optimizer]\nlr = 1e-3\n[run]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[run\]: \[run\], \[model\] and \[data\] make this an "
                                          r"`infinity train` job file .*`infinity train --config FILE` reads; "
                                          r"infinity.Config reads the engine's sections only"):
        Config.from_file(path)
    path.write_text("lr = 1e-3\n")
    with pytest.raises(ConfigError, match=r"lr = 0.001 is a key outside any section .*it is a key of \[optimizer\]"):
        Config.from_file(path)


def test_overrides_are_toml_parsed():
    config = Config.from_dict(
        {"optimizer": {"lr": 1.0}},
        overrides=["optimizer.lr=1e-3", "placement.params=host", 'placement.grads="host"',
                   "optimizer.betas=[0.9, 0.99]", "io.direct=false", "memory.host_budget=12GiB",
                   "io.block_size=4096", "units.classes=[\"Block\"]"],
    )
    assert config.optimizer.lr == 1e-3
    assert config.placement.params == "host" and config.placement.grads == "host"
    assert config.optimizer.betas == (0.9, 0.99)
    assert config.io.direct is False
    assert config.memory.host_budget == 12 * GiB and config.io.block_size == 4096
    assert config.units.classes == ("Block",)
    again = config.with_overrides(["optimizer.lr=2e-3"])
    assert again.optimizer.lr == 2e-3 and again.placement.params == "host"
    assert config.optimizer.lr == 1e-3  # frozen: the original is unchanged


def test_frozen_and_hashable():
    config = Config()
    with pytest.raises(AttributeError):
        config.optimizer.lr = 1.0  # type: ignore[misc]
    assert hash(config) == hash(Config())


@pytest.mark.parametrize(
    "text, num_bytes",
    [("12GiB", 12 * GiB), ("12 GB", 12 * 10**9), (4096, 4096), ("4096", 4096), ("1.5GiB", 3 * GiB // 2),
     ("1MiB", 2**20), ("1mib", 2**20), ("2 KB", 2000), ("7B", 7), (0, 0), ("1_000", 1000), (8.0, 8)],
)
def test_parse_size(text, num_bytes):
    assert parse_size(text, "k") == num_bytes


@pytest.mark.parametrize("text", ["12 GiBs", "-1GiB", "1.5", "GiB", "", "1e9", "12 G", 1.5, -1, None, True])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match=r"^memory\.host_budget = "):
        parse_size(text, "memory.host_budget")


@pytest.mark.parametrize("num_bytes, text", [(2**20, "1MiB"), (12 * 10**9, "12GB"), (3 * GiB // 2, "1536MiB"),
                                             (4097, "4097"), (0, "0"), (4 * GiB, "4GiB")])
def test_format_size_round_trips(num_bytes, text):
    assert format_size(num_bytes) == text
    assert parse_size(format_size(num_bytes), "k") == num_bytes
    assert format_size(12 * 10**9, exact=False) == "11.18GiB"


def test_defaults_text_parses_back_to_defaults():
    text = Config.defaults_text()
    data = tomllib.loads(text)
    assert Config.from_dict(data) == Config()
    for key, _type_name, _default, help_text in Config.reference():
        section, name = key.split(".")
        assert name in data[section], key
        assert help_text, key
    assert "# Peak learning rate" in text


def test_reference_lists_every_key_once():
    keys = [key for key, *_ in Config.reference()]
    assert len(keys) == len(set(keys))
    flat = {f"{s}.{k}" for s, table in Config().to_dict().items() for k in table}
    assert set(keys) == flat
    row = dict((key, (type_name, default)) for key, type_name, default, _ in Config.reference())
    assert row["io.block_size"] == ("size", "1MiB")
    assert row["optimizer.name"] == ('"adam" | "adamw"', "adamw")
    assert row["memory.host_budget"] == ('size | "auto"', "auto")


def test_a_json_config_and_job_file_read_as_their_toml(tmp_path):
    """`--config job.json` and Config.from_file("run.json"): the same sections and keys as TOML, the same job;
    invalid JSON and a JSON text under another name are errors that say so."""
    import json

    from infinity.job.spec import load_job
    tables = {"optimizer": {"lr": 1e-3, "betas": [0.9, 0.99]}, "run": {"steps": 7}, "model": {"n_layer": 2}}
    (tmp_path / "job.json").write_text(json.dumps(tables))
    (tmp_path / "job.toml").write_text('[optimizer]\nlr = 1e-3\nbetas = [0.9, 0.99]\n[run]\nsteps = 7\n'
                                       '[model]\nn_layer = 2\n')
    a, b = load_job(tmp_path / "job.json"), load_job(tmp_path / "job.toml")
    assert (a.run, a.model, a.engine_config("r")) == (b.run, b.model, b.engine_config("r"))
    (tmp_path / "run.json").write_text(json.dumps({"optimizer": {"lr": 2e-3}}))
    assert Config.from_file(tmp_path / "run.json") == Config.from_dict({"optimizer": {"lr": 2e-3}})
    (tmp_path / "bad.json").write_text('{"optimizer": ')
    with pytest.raises(ConfigError, match="bad.json: invalid JSON"):
        load_job(tmp_path / "bad.json")
    (tmp_path / "json.toml").write_text(json.dumps(tables))
    with pytest.raises(ConfigError, match=r"invalid TOML.*a JSON file must end in .json"):
        load_job(tmp_path / "json.toml")
