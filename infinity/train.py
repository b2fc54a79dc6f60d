"""The training job behind `infinity train`: config, model, run directory, loop, report.

    infinity train                                   # the built-in default: a small byte-level GPT on infinity/corpus/kjv.txt.gz
    infinity train --config run.toml --set run.steps=500 --set model.kind=llama
    infinity train --resume runs/<name> --set run.steps=1000   # continue a run from its latest checkpoint
    torchrun --nproc-per-node 2 -m infinity train    # or: torchrun --nproc-per-node 2 $(which infinity) train

A job file is an engine config (every section of `infinity config --defaults`)
plus three sections of its own, `[run]`, `[model]` and `[data]`; keys a file
leaves out take the job's defaults (`TRAIN_DEFAULTS`: parameters and optimizer
state on NVMe under the run directory, AdamW with cosine decay), then the
engine's. `--set section.key=value` overrides either kind of key.

Run directory (`run.dir`/`run.name`, default runs/<date>-<time>):

    config.toml          the resolved config (train again with --config runs/<name>/config.toml)
    estimate.json        what `infinity estimate` predicted for this run
    metrics.jsonl        one JSON object per optimizer step (and per validation)
    memory_report.json   engine.memory_report() of rank 0 at the end, peak RSS of every rank
    summary.json         status (completed / interrupted), first / last loss, validation loss, throughput
    profile/             the profiler's summary and chart (when the engine has a profiler)
    checkpoint/          the final checkpoint (when the engine can save one)
    checkpoints/step-N/  periodic checkpoints (run.checkpoint_every)
    swap/                the NVMe swap files while the run is alive (removed at the end)

Note [clean stop]: Ctrl-C (SIGINT, or the SIGTERM torchrun sends its workers)
only raises a flag; every rank learns of it at the end of the step through the
per-step all-reduce of the loss, so all ranks stop after the same step, then
write the report and checkpoint as on completion. A second Ctrl-C stops at once.

Note [resume] (checkpoints carry the training position; `--resume`): infinity/resume.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import signal
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import _SECTIONS, Config, ConfigError, _did_you_mean, _option, _parse_override, _Section, _show
from .data import VOCAB_SIZE, Batches, DataConfig
from .optim.schedule import lr_at
from .resume import FINAL_CHECKPOINT, PERIODIC_CHECKPOINTS, Resume, earlier_losses, train_position, trim_metrics, write_atomic

# ---------------------------------------------------------------- job config


@dataclass(frozen=True, kw_only=True)
class RunConfig(_Section):
    """The training run of `infinity train`: length, batch, run directory, reporting."""

    SECTION: ClassVar[str] = "run"

    steps: int = _option(300, "Optimizer steps to train.", "int", ge=1)
    batch_size: int = _option(16, "Sequences per micro-batch over all ranks (each rank takes batch_size / "
                              "world size).", "int", ge=1)
    dir: str = _option("runs", "Directory that holds run directories.", "str")
    name: str = _option("auto", 'Name of this run\'s directory under run.dir; "auto" = the start time '
                        "(YYYYmmdd-HHMMSS).", "str")
    eval_every: int = _option(100, "Steps between validation losses (0 = only at the end).", "int", ge=0)
    eval_batches: int = _option(4, "Batches per validation loss.", "int", ge=1)
    log_every: int = _option(10, "Steps between progress lines when the output is not a terminal.", "int", ge=1)
    checkpoint: bool = _option(True, "Save a final checkpoint into the run directory (when the engine "
                               "supports checkpoints).", "bool")
    checkpoint_every: int = _option(0, "Steps between checkpoints saved into checkpoints/step-<N> of the run "
                                    "directory, for `infinity train --resume` after a crash (0 = only the final "
                                    "one; [checkpoint] keep_last limits how many stay).", "int", ge=0)


@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    """The model `infinity train` builds (on the meta device; nothing is downloaded)."""

    SECTION: ClassVar[str] = "model"

    kind: str = _option("gpt", '"gpt": infinity.models.GPT; "gpt2" / "llama": the Hugging Face transformers '
                        "model built from a config (pip install transformers).", "enum",
                        choices=("gpt", "gpt2", "llama"))
    n_layer: int = _option(4, "Transformer blocks (one unit each).", "int", ge=1)
    d_model: int = _option(128, "Hidden size.", "int", ge=8)
    n_head: int = _option(4, "Attention heads (must divide d_model).", "int", ge=1)
    n_kv_head: int = _option(0, "Key/value heads of llama (grouped-query attention); 0 = n_head.", "int", ge=0)
    ffn_dim: int = _option(0, "MLP hidden size; 0 = 4 * d_model (gpt, gpt2) or the llama default.", "int", ge=0)
    seq_len: int = _option(128, "Tokens (bytes) per training sequence.", "int", ge=2)
    vocab_size: int = _option(VOCAB_SIZE, "Vocabulary size; the data is bytes, so at least 256.", "int",
                              ge=VOCAB_SIZE)

    def _check(self) -> None:
        if self.d_model % self.n_head:
            raise ConfigError(f"model.n_head = {self.n_head}: must divide model.d_model = {self.d_model}; "
                              f"e.g. n_head = {math.gcd(self.d_model, 8) or 1}")
        kv = self.n_kv_head or self.n_head
        if self.kind == "llama" and self.n_head % kv:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: must divide model.n_head = {self.n_head}")
        if self.kind != "llama" and self.n_kv_head:
            raise ConfigError(f"model.n_kv_head = {self.n_kv_head}: only llama has grouped-query attention; "
                              f'remove it or set model.kind = "llama"')


JOB_SECTIONS: dict[str, type[_Section]] = {"run": RunConfig, "model": ModelConfig, "data": DataConfig}

# The engine config of `infinity train` where it differs from Config(): state on NVMe, AdamW + cosine.
TRAIN_DEFAULTS = {
    "optimizer": {"lr": 2e-3, "weight_decay": 0.1, "grad_clip": 1.0},
    "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"},
    "profile": {"enabled": True},  # the overlap efficiency on the progress line, profile/ in the run directory
}
DECAY_DEFAULTS = {"schedule": "cosine", "min_lr_ratio": 0.1}  # applied when the user sets no schedule


@dataclass(frozen=True)
class Job:
    """A validated job: its own sections, and the user's engine keys (resolved by `engine_config`)."""

    run: RunConfig
    model: ModelConfig
    data: DataConfig
    engine_keys: dict  # section -> {key: value}, as the user gave them

    def engine_config(self, run_dir: str) -> Config:
        """The engine Config: user keys over TRAIN_DEFAULTS over Config(). Unless set, swap files go to
        <run_dir>/swap and the profile (spans, overlap summary, chart) to <run_dir>/profile."""
        user = self.engine_keys
        merged = {s: dict(v) for s, v in TRAIN_DEFAULTS.items()}
        if user.get("placement", {}).get("policy") == "auto":
            merged.pop("placement")  # auto plans every tier itself
        for section, table in user.items():
            merged.setdefault(section, {}).update(table)
        opt = merged["optimizer"]
        if "schedule" not in user.get("optimizer", {}):
            opt.update(DECAY_DEFAULTS)
            opt.setdefault("warmup_steps", min(20, self.run.steps // 10))
        if opt.get("schedule", "constant") != "constant":
            opt.setdefault("total_steps", max(self.run.steps, opt.get("warmup_steps", 0) + 1))
        merged.setdefault("nvme", {}).setdefault("paths", [os.path.join(run_dir, "swap")])
        merged["profile"].setdefault("trace_dir", os.path.join(run_dir, "profile"))
        return Config.from_dict(merged)


def load_job(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> Job:
    """Read a job file (or none: the defaults) and apply `section.key=value` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        except OSError as e:
            raise ConfigError(f"--config {path}: cannot read it ({e.strerror}); give the path of a TOML file") from None
    tables: dict[str, dict] = {}
    for section, table in data.items():
        _check_section(section)
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] = {_show(table)}: a section must be a table, e.g. [{section}] on its "
                              f"own line followed by key = value lines")
        tables[section] = dict(table)
    for item in overrides:
        section, key, value = _parse_override(item)
        _check_section(section)
        tables.setdefault(section, {})[key] = value
    job_parts = {}
    for name, cls in JOB_SECTIONS.items():
        table = tables.pop(name, {})
        for key in table:
            if key not in {f.name for f in dataclasses.fields(cls)}:
                valid = [f.name for f in dataclasses.fields(cls)]
                raise ConfigError(f"unknown key {name}.{key}{_did_you_mean(key, valid)}; valid keys of [{name}]: "
                                  f"{', '.join(valid)}")
        job_parts[name] = cls(**table)
    job = Job(engine_keys=tables, **job_parts)
    job.engine_config(os.path.join(job.run.dir, "<run>"))  # validate now, before any directory exists
    return job


def _check_section(section: str) -> None:
    valid = list(_SECTIONS) + list(JOB_SECTIONS)
    if section not in valid:
        raise ConfigError(f"unknown section [{section}]{_did_you_mean(section, valid)}; valid sections: "
                          f"{', '.join(valid)}")


def job_defaults_text() -> str:
    """The job's own sections at their defaults, commented (appended to `infinity config --defaults`)."""
    import textwrap

    from .config import _render_default, _type_name
    lines = ["# infinity train: the job's own sections (engine keys above; the job's defaults for them:",
             f"# {json.dumps(TRAIN_DEFAULTS)}, plus {json.dumps(DECAY_DEFAULTS)} with warmup min(20, steps/10)",
             "# and nvme.paths = [<run directory>/swap], profile.trace_dir = <run directory>/profile).", ""]
    for section, cls in JOB_SECTIONS.items():
        lines += [f"# {cls.__doc__}", f"[{section}]"]
        for f in dataclasses.fields(cls):
            lines += textwrap.wrap(f"{f.metadata['help']} ({_type_name(f.metadata)})", width=88,
                                   initial_indent="# ", subsequent_indent="# ")
            lines.append(f"{f.name} = {_show(_render_default(f.default, f.metadata))}")
        lines.append("")
    return "\n".join(lines)


def to_toml(config: Config, job: Job) -> str:
    """The resolved config as TOML (engine sections, then the job's)."""
    lines = ["# Resolved by infinity train; train again with: infinity train --config <this file>", ""]
    tables = {**config.to_dict(), **{name: getattr(job, name).to_dict() for name in JOB_SECTIONS}}
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_show(value)}" for key, value in table.items()]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------- models


@dataclass
class ModelBundle:
    """A model on the meta device, how to initialize it, and how to get its loss from a batch."""

    model: nn.Module
    init_fn: Callable[[nn.Module], None] | None
    loss: Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]  # loss(forward, x, y)
    description: str


def _lm_loss(forward, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of a Hugging Face causal LM: cross-entropy of its logits against the next bytes."""
    logits = forward(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def build_model(cfg: ModelConfig, *, meta: bool = True) -> ModelBundle:
    """The model of `cfg`, created under infinity.meta_init() (no parameter memory) unless `meta=False`."""
    import contextlib

    from .materialize import meta_init
    scope = meta_init() if meta else contextlib.nullcontext()
    if cfg.kind == "gpt":
        from .models.gpt import GPT, GPTConfig, gpt_init
        gcfg = GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         d_model=cfg.d_model)
        if cfg.ffn_dim not in (0, 4 * cfg.d_model):
            raise ConfigError(f"model.ffn_dim = {cfg.ffn_dim}: the built-in gpt uses 4 * d_model = "
                              f"{4 * cfg.d_model}; remove it or use model.kind = \"gpt2\" / \"llama\"")
        with scope:
            model = GPT(gcfg)
        return ModelBundle(model, gpt_init, lambda fwd, x, y: fwd(x, y), f"gpt {_count(model)}")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f'model.kind = "{cfg.kind}" needs Hugging Face transformers: pip install transformers '
                          f'(or use model.kind = "gpt")') from None
    if cfg.kind == "gpt2":
        hf_cfg = transformers.GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
                                         n_layer=cfg.n_layer, n_head=cfg.n_head, n_inner=cfg.ffn_dim or None,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                         eos_token_id=None)
        cls = transformers.GPT2LMHeadModel
    else:
        ffn = cfg.ffn_dim or 64 * -(-(8 * cfg.d_model // 3) // 64)  # llama's 8/3 d, rounded up to 64
        hf_cfg = transformers.LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=ffn,
                                          num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
                                          num_key_value_heads=cfg.n_kv_head or cfg.n_head,
                                          max_position_embeddings=cfg.seq_len, bos_token_id=None, eos_token_id=None,
                                          pad_token_id=None)
        cls = transformers.LlamaForCausalLM
    with scope:
        model = cls(hf_cfg)
    return ModelBundle(model, model._init_weights, _lm_loss, f"{cfg.kind} (transformers) {_count(model)}")


def _count(model: nn.Module) -> str:
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return f"{n / 1e6:.2f}M parameters"


# ---------------------------------------------------------------- processes


def setup_distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether this call created the process group); joins torchrun's group."""
    import torch.distributed as dist
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, 1, False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), dist.get_world_size(), True


def _agree(value, world: int):
    """Rank 0's value of a picklable object on every rank."""
    if world == 1:
        return value
    import torch.distributed as dist
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _gather(value, world: int) -> list:
    if world == 1:
        return [value]
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist
        dist.barrier()


class StopFlag:
    """Note [clean stop]: SIGINT / SIGTERM set a flag; a second signal interrupts at once."""

    def __init__(self):
        self.raised = False
        self._previous = {}

    def __enter__(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True
        print(f"\n{signal.Signals(signum).name}: stopping after this step (again to stop now)", file=sys.stderr,
              flush=True)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


# ---------------------------------------------------------------- reporting


class Progress:
    """One status line: redrawn in place on a terminal, printed every `every` steps otherwise."""

    def __init__(self, total: int, every: int, enabled: bool, stream=None, first_step: int = 0):
        self.total, self.every, self.enabled = total, every, enabled
        self.first_step = first_step  # steps done before this process started (a resumed run)
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._closed = False

    def update(self, step: int, loss: float, tokens_per_s: float, overlap: float | None) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(1, step - self.first_step) * (self.total - step)
        width = 24
        filled = int(width * step / self.total)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (width - filled)}] "
                f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  overlap {'-' if overlap is None else f'{overlap:.0%}'}"
                f"  {_clock(elapsed)}<{_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total or step == self.first_step + 1:
            print(line, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.tty and not self._closed else "") + text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and not self._closed:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 60}:{seconds % 60:02d}" if seconds < 3600 else f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def overlap_efficiency(engine) -> float | None:
    """The overlap efficiency (compute time / step time, 0..1) of the latest profiled step, when the engine
    has a profiler (`infinity.profile`), else None. Only the last step is summarized: summarizing every
    step each time would cost more the longer the run."""
    profiler = getattr(engine, "profiler", None)
    if profiler is None or not getattr(profiler, "enabled", True):
        return None
    try:
        if hasattr(profiler, "steps") and hasattr(profiler, "spans"):
            from .profile import summarize
            last = profiler.steps()[-1:]
            if not last:
                return None
            spans = [s for s in profiler.spans() if s.end >= last[0].begin]
            summary = summarize(spans, last)
        else:
            summary = profiler.summary()
    except Exception:  # noqa: BLE001 - a profiler with nothing recorded yet must not stop training
        return None
    if not isinstance(summary, dict):
        return None
    steps = summary.get("steps") or []
    for source in (steps[-1] if steps else {}, summary.get("median") or {}, summary):
        value = source.get("overlap_efficiency") if isinstance(source, dict) else None
        if isinstance(value, (int, float)):
            return float(value)
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _json_default(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "value"):  # enums (Tier, Kind)
        return value.value
    return repr(value)


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(data, indent=1, default=_json_default) + "\n")


# ---------------------------------------------------------------- the run


@dataclass
class Result:
    """What `train` returns (every rank)."""

    run_dir: Path
    status: str  # "completed" | "interrupted"
    steps: int
    losses: list[float]
    val_loss: float | None
    seconds: float


def _run_name(run: RunConfig) -> str:
    return time.strftime("%Y%m%d-%H%M%S") if run.name == "auto" else run.name


def train(job: Job, *, verbose: bool = True, resume: Resume | None = None) -> Result:
    """Run the job: every rank calls this (under torchrun, or alone). With `resume` (from `load_resume`),
    continue that run from its checkpoint (Note [resume])."""
    rank, world, owns_group = setup_distributed()
    try:
        return _run(job, rank, world, verbose, resume)
    finally:
        if owns_group:
            import torch.distributed as dist
            dist.destroy_process_group()


def _run(job: Job, rank: int, world: int, verbose: bool, resume: Resume | None) -> Result:
    import infinity

    if resume is None:
        run_dir = Path(_agree(os.path.join(job.run.dir, _run_name(job.run)), world))
        taken = rank == 0 and run_dir.exists() and any(p.name != "swap" for p in run_dir.iterdir())
        if _agree(taken, world):
            raise ConfigError(f"run directory {run_dir} already holds a run: choose another run.name, leave "
                              f'run.name = "auto", or continue it with infinity train --resume {run_dir}')
    else:
        run_dir = Path(_agree(str(resume.run_dir), world))
    swap_dir = run_dir / "swap"
    config = job.engine_config(str(run_dir))
    batches = Batches.from_config(job.data, seq_len=job.model.seq_len, global_batch=job.run.batch_size,
                                  rank=rank, world=world)  # bad data settings fail before any work
    from .preflight import prepare_nvme_paths
    prepare_nvme_paths(list(config.nvme.paths))  # a path that is a file: exit 2 naming it (Note [nvme paths])
    os.makedirs(run_dir, exist_ok=True)
    start = resume.step if resume else 0
    say = Progress(job.run.steps, job.run.log_every, enabled=verbose and rank == 0, first_step=start)
    earlier: list[float] = []
    if rank == 0 and resume is None:
        write_atomic(run_dir / "config.toml", to_toml(config, job))
    _measure_links(config, world)
    bundle = build_model(job.model)
    engine = infinity.initialize(bundle.model, config, init_fn=bundle.init_fn)
    try:
        if resume is not None:
            saved = engine.load_checkpoint(str(resume.checkpoint)).get("train", {})
            assert saved.get("step") == start, f"{resume.checkpoint} is at step {saved.get('step')}, not {start}"
            if rank == 0:  # only now: a resume that fails to start leaves the run's files as they were
                write_atomic(run_dir / "config.toml", to_toml(config, job))
                dropped = trim_metrics(run_dir / "metrics.jsonl", start)  # steps after the checkpoint: trained again
                if dropped:
                    say.note(f"dropped {dropped} metrics record(s) of steps after the checkpoint (step {start})")
                earlier = earlier_losses(run_dir / "metrics.jsonl")
            say.note(f"resuming {run_dir} at step {start} from {resume.checkpoint}")
            o = config.optimizer
            if o.schedule != "constant" and job.run.steps > o.total_steps:
                say.note(f"note: the learning rate reaches its final value at optimizer.total_steps = {o.total_steps} "
                         f"and stays there until run.steps = {job.run.steps}; --set optimizer.total_steps="
                         f"{job.run.steps} to stretch the schedule instead")
        say.note(f"{bundle.description}, {len(engine.units)} units, world size {world}, device {engine.device}, "
                 f"placement {_placement_text(engine)}; run directory {run_dir}")
        with StopFlag() as stop, (run_dir / "metrics.jsonl").open("a") if rank == 0 else _Null() as metrics:
            result = _loop(job, config, engine, bundle, batches, stop, metrics, say, run_dir, start=start,
                           elapsed_before=resume.elapsed_s if resume else 0.0)
        result.losses = earlier + result.losses  # the whole run's (rank 0 reads the earlier ones from metrics.jsonl)
        _finish(job, config, engine, run_dir, result, world, rank, say, resume)
    finally:
        engine.close()  # waits for in-flight I/O and removes this rank's swap files
        say.close()
        if swap_dir.is_dir() and not any(swap_dir.iterdir()):
            shutil.rmtree(swap_dir, ignore_errors=True)
    return result


class _Null:
    """A metrics sink for ranks other than 0."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


def _placement_text(engine) -> str:
    cfg = engine.config.placement
    if cfg.policy == "static":
        return f"params={cfg.params} grads={cfg.grads} optimizer={cfg.optimizer}"
    return "auto (" + "; ".join(engine.plan.reasons[:3]) + ")"


def _measure_links(config: Config, world: int) -> None:
    """The auto policy plans with this machine's link rates: measure them once (local rank 0), then cached."""
    from .link_rates import link_rates
    if config.placement.policy == "auto" and config.nvme.paths:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            link_rates(config.nvme.paths[0], io_config=config.io)
        _barrier(world)


def _estimate(job: Job, config: Config, world: int, say: Progress):
    """What `infinity estimate` predicts for this run (run after training, so it does not add to the
    measured peak memory)."""
    from . import estimate as est
    try:
        return est.estimate(lambda: build_model(job.model), config, world_size=world,
                            batch_size=job.run.batch_size // world, seq_len=job.model.seq_len)
    except Exception as e:  # noqa: BLE001 - a failed prediction must not fail a finished run
        say.note(f"(no estimate: {type(e).__name__}: {e})")
        return None


def _loop(job: Job, config: Config, engine, bundle: ModelBundle, batches: Batches, stop: StopFlag, metrics,
          say: Progress, run_dir: Path, *, start: int = 0, elapsed_before: float = 0.0) -> Result:
    """Steps start + 1 .. run.steps (start > 0 when resuming: the batches and LR continue from there)."""
    accum = config.train.grad_accum_steps
    device = engine.device
    tokens_per_step = batches.tokens_per_batch * accum
    losses: list[float] = []
    val_loss = None
    status = "completed"
    began = time.perf_counter() - elapsed_before
    recent: list[float] = []
    step, overlap = start, None
    every = job.run.checkpoint_every
    for step in range(start + 1, job.run.steps + 1):
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(accum):
            x, y = (t.to(device, non_blocking=True) for t in batches.batch(step - 1, micro))
            loss = bundle.loss(engine, x, y)
            engine.backward(loss)
            total += loss.detach().double()
        engine.step()
        mean_loss, stopping = _reduce_step(total / accum, stop.raised, device, engine.world_size)
        seconds = time.perf_counter() - t0
        recent = (recent + [seconds])[-10:]
        losses.append(mean_loss)
        if step % job.run.log_every == 0 or step <= 2 or step == job.run.steps:
            overlap = overlap_efficiency(engine)  # summarizing the spans costs time: not every step
        record = {"step": step, "loss": mean_loss, "lr": lr_at(step - 1, config.optimizer),
                  "grad_norm": engine.last_grad_norm, "step_time_s": seconds,
                  "tokens_per_s": tokens_per_step / seconds, "tokens": step * tokens_per_step,
                  "elapsed_s": time.perf_counter() - began, "overlap_efficiency": overlap}
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"the loss is {mean_loss} at step {step}: lower optimizer.lr or raise "
                                     f"optimizer.warmup_steps")
        last = step == job.run.steps or stopping
        if job.run.eval_every and step % job.run.eval_every == 0 or last:
            val_loss = _validate(engine, bundle, batches, job.run.eval_batches, device)
            record["val_loss"] = val_loss
            say.note(f"step {step}: validation loss {val_loss:.4f}")
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()
        say.update(step, mean_loss, tokens_per_step * len(recent) / sum(recent), overlap)
        if stopping:
            status = "interrupted"
            break
        if every and step % every == 0 and not last and job.run.checkpoint:  # the last step gets the final one
            engine.save_checkpoint(str(run_dir / PERIODIC_CHECKPOINTS / f"step-{step:08d}"),
                                   user_state=train_position(job, config, step, time.perf_counter() - began,
                                                             engine.world_size))
    return Result(run_dir=run_dir, status=status, steps=step, losses=losses, val_loss=val_loss,
                  seconds=time.perf_counter() - began)


def _reduce_step(loss: torch.Tensor, stop: bool, device: torch.device, world: int) -> tuple[float, bool]:
    """Mean loss over ranks, and whether any rank was asked to stop (Note [clean stop])."""
    if world == 1:
        return float(loss), stop
    import torch.distributed as dist
    packed = torch.stack([loss.double(), torch.tensor(float(stop), dtype=torch.float64, device=device)])
    dist.all_reduce(packed)  # every rank sees the same stop decision, so all stop after the same step
    return float(packed[0]) / world, bool(packed[1] > 0)


@torch.no_grad()
def _validate(engine, bundle: ModelBundle, batches: Batches, count: int, device: torch.device) -> float:
    engine.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches.val_batches(count):
        total += bundle.loss(engine, x.to(device), y.to(device)).double()
    engine.train()
    value, _ = _reduce_step(total / count, False, device, engine.world_size)
    return value


def _save_final(job: Job, config: Config, engine, run_dir: Path, result: Result, world: int, rank: int) -> Path:
    """The final checkpoint into <run>/checkpoint. A resumed run already has one: the new one is saved beside
    it and replaces it by renames; until the old one is removed both are complete, and `latest_checkpoint`
    takes the one with more steps (Note [resume])."""
    final = run_dir / FINAL_CHECKPOINT
    position = train_position(job, config, result.steps, result.seconds, world)
    replace = _agree(final.exists(), world)
    target = run_dir / f"{FINAL_CHECKPOINT}.new-{result.steps:08d}" if replace else final
    if rank == 0 and target.exists():
        shutil.rmtree(target)  # left by a save that crashed while replacing; `final` is newer or as new
    _barrier(world)
    engine.save_checkpoint(str(target), user_state=position)
    engine.wait_for_checkpoint()  # committed (visible, complete) before it replaces the old one
    if replace and rank == 0:
        old = run_dir / f"{FINAL_CHECKPOINT}.old-{result.steps:08d}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(target, final)
        for stale in run_dir.iterdir():  # this one and any a crashed replacement left
            if stale.is_dir() and stale.name.startswith((f"{FINAL_CHECKPOINT}.old-", f"{FINAL_CHECKPOINT}.new-")):
                shutil.rmtree(stale, ignore_errors=True)
    _barrier(world)
    return final


def _finish(job: Job, config: Config, engine, run_dir: Path, result: Result, world: int, rank: int,
            say: Progress, resume: Resume | None = None) -> None:
    """Checkpoint, profile, memory report and summary (Note [clean stop]: also after an interrupt)."""
    checkpoint = None
    if job.run.checkpoint and hasattr(engine, "save_checkpoint"):
        checkpoint = _save_final(job, config, engine, run_dir, result, world, rank)
    report = engine.memory_report()
    peaks = _gather(peak_rss_bytes(), world)
    if rank != 0:
        return
    report["peak_rss_bytes_per_rank"] = peaks
    write_json(run_dir / "memory_report.json", report)
    summary = {
        "status": result.status, "steps": result.steps, "world_size": world,
        "first_loss": result.losses[0] if result.losses else None,
        "last_loss": result.losses[-1] if result.losses else None, "val_loss": result.val_loss,
        "seconds": result.seconds,
        "tokens_per_s": result.steps * job.run.batch_size * job.model.seq_len
        * engine.config.train.grad_accum_steps / result.seconds if result.seconds else None,
        "peak_rss_bytes": peaks[0], "checkpoint": str(checkpoint) if checkpoint else None,
        "overlap_efficiency": overlap_efficiency(engine),
    }
    if resume is not None:
        summary["resumed"] = {"from": str(resume.checkpoint), "at_step": resume.step}
    estimate = _estimate(job, config, world, say)
    if estimate is not None:
        write_json(run_dir / "estimate.json", estimate.to_json())
        summary["predicted"] = {"peak_rss_bytes": estimate.peak.get("ram"),
                                "step_seconds": estimate.step_time.total if estimate.step_time else None}
    write_json(run_dir / "summary.json", summary)
    say.close()
    say.note(f"{result.status} after {result.steps} steps in {result.seconds:.1f} s: loss {summary['first_loss']:.4f} "
             f"-> {summary['last_loss']:.4f}, validation {result.val_loss:.4f}; peak RSS "
             f"{peaks[0] / 2**20:.0f} MiB; run directory {run_dir}")
