"""The training job behind `infinity train`: run directory, loop, report.

    infinity train                                   # the default: a small byte-level GPT on the shipped corpus
    infinity train --config run.toml --set run.steps=500 --set model.kind=llama
    infinity train --resume runs/<name> --set run.steps=1000   # continue a run from its latest checkpoint
    infinity train --set model.pretrained=DIR --set model.lora.r=8  # fine-tune a Hugging Face model (LoRA)
    torchrun --nproc-per-node 2 -m infinity train    # or: torchrun --nproc-per-node 2 $(which infinity) train

The job file, its sections and the models: infinity/job/spec.py. The run directory, its lock and
what a failed start leaves: infinity/job/run_dir.py. The progress line: infinity/job/progress.py.

Run directory (`run.dir`/`run.name`, default runs/<date>-<time>):

    config.toml          the resolved config (train again with --config runs/<name>/config.toml)
    estimate.json        what `infinity estimate` predicted for this run
    metrics.jsonl        one JSON object per optimizer step (and per validation)
    memory_report.json   engine.memory_report() of rank 0 at the end, peak RSS of every rank
    summary.json         status (completed / interrupted / aborted / failed), first / last loss, validation
                         loss, throughput; when the run did not finish: the error and what to do
    profile/             the profiler's summary and chart (when the engine has a profiler)
    checkpoint/          the final checkpoint (when the engine can save one)
    checkpoints/step-N/  periodic checkpoints (run.checkpoint_every)
    export/              with model.pretrained: the trained model as a Hugging Face directory (run.export;
                         Note [fine-tuning job] in job/spec.py)
    swap/                the NVMe swap files (mode 0700) while the run is alive (removed at the end)
    .lock                held by the job using the directory (Note [run directory lock])

Note [clean stop]: Ctrl-C (SIGINT, or the SIGTERM torchrun sends its workers)
only raises a flag; every rank learns of it at the end of the step through the
per-step all-reduce of the loss, so all ranks stop after the same step, then
write the report and checkpoint as on completion. A second Ctrl-C stops at once;
summary.json then says "aborted" and names the checkpoint to resume from. A run
that fails after it started (a save that found no space, a diverged loss) writes
summary.json too: status "failed", the error, and the checkpoint to resume from.
The flag's handlers stay from the first step to the end of the cleanup (the final
save, summary.json, close, the swap removed): when one rank of a torchrun job dies,
torchrun sends the others SIGTERM at once, and a rank that had just left the loop
with the lost peer's error used to die of it before writing summary.json or
removing its swap files.

Note [time limit]: `run.time_limit` ("3h50m") stops a run in time for its final checkpoint: after each step the
flag is raised when one more step (the slowest so far) and the final save (as long as the last periodic save,
else one step) would pass the limit, counted from the start of `train`; every rank learns of it through the
same all-reduce as a signal's, so all stop after the same step, save and report as on Ctrl-C, and summary.json's
"stopped_by" names the limit. SIGUSR1 (what Slurm's `--signal=USR1@120` sends before its kill) stops the run as
SIGINT and SIGTERM do. `--resume` continues it bit for bit (the position is in the checkpoint as ever).

Note [resume] (checkpoints carry the training position; `--resume`): infinity/job/resume.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infinity.config.job import parse_duration
from infinity.config.options import show
from infinity.config.sections import Config, ConfigError
from infinity.data.ahead import BatchesAhead, to_device
from infinity.data.batches import Batches
from infinity.data.tokenized import job_batches, resolve_data_format
from infinity.device.process_group import (
    barrier,
    broadcast_object,
    default_group,
    gather_object,
    join_process_group,
    rank_and_world,
)
from infinity.device.streams import host_value, to_host
from infinity.job.metrics import Earlier, Metrics, memory_fields
from infinity.job.prediction import reserve_activations, run_estimate, start_budgets
from infinity.job.progress import Progress, overlap_efficiency, peak_rss_bytes
from infinity.job.resume import (
    FINAL_CHECKPOINT,
    PERIODIC_CHECKPOINTS,
    Resume,
    keep_profile_segments,
    run_checkpoints,
    set_aside,
    stopped_summary,
    train_position,
)
from infinity.job.run_dir import RunDir, write_json
from infinity.job.spec import EXPORT, Job, to_toml
from infinity.job.trackers import check_installed, trackers
from infinity.models.build import ModelBundle, build_model
from infinity.optim.schedule import lr_at
from infinity.profile import NullProfiler
from infinity.state.checkpoint import count_as_written
from io_engine import atomic_write

# ---------------------------------------------------------------- processes


def setup_distributed() -> tuple[int, int, bool]:
    """(rank, world size, whether this call created the process group); joins torchrun's group."""
    owns = join_process_group()
    rank, world = rank_and_world(default_group())
    return rank, world, owns


class StopFlag:
    """Note [clean stop]: SIGINT / SIGTERM set a flag; a second signal interrupts at once."""

    def __init__(self, time_limit_s: float | None = None):
        self.raised = False
        self.reason: str | None = None  # what raised it: a signal's name, or the time limit
        self.training = True  # False once the loop has ended: a signal then cuts the cleanup short, not a step
        self._previous = {}
        self.deadline = None if time_limit_s is None else time.monotonic() + time_limit_s  # Note [time limit]
        self.slowest_step = 0.0  # of the steps so far: the next one may take as long
        self.save_s = 0.0  # the last checkpoint save's time (the final save is counted as long)

    def check_time(self, step_s: float, limit: str) -> None:
        """Note [time limit]: raise the flag when one more step and the final save would pass the deadline."""
        self.slowest_step = max(self.slowest_step, step_s)
        if self.deadline is not None and not self.raised and \
                time.monotonic() + self.slowest_step + max(self.save_s, self.slowest_step) >= self.deadline:
            self.raised, self.reason = True, f"run.time_limit = {limit}"

    def install(self) -> None:
        """The handlers, from the first step until `restore` (after the run's cleanup: Note [clean stop])."""
        if self._previous:  # (installed already)
            return
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):  # (SIGUSR1: Slurm's --signal, before the kill)
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass

    def _handle(self, signum, frame) -> None:
        if self.raised:
            raise KeyboardInterrupt
        self.raised = True
        self.reason = self.reason or signal.Signals(signum).name
        what = "stopping after this step" if self.training else "finishing the report, checkpoint and cleanup"
        print(f"\n{signal.Signals(signum).name}: {what} (again to stop now)", file=sys.stderr, flush=True)

    def restore(self) -> None:
        """The handlers there were before `install`."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


# ---------------------------------------------------------------- the run


@dataclass
class Result:
    """What `train` returns (every rank)."""

    run_dir: Path
    status: str  # "starting" | "running" | "completed" | "interrupted"
    steps: int
    losses: list[float]
    val_loss: float | None
    seconds: float
    step_tokens: list[int] = field(default_factory=list)  # trained tokens (not pad, not -100) of each step run here
    tokens_before: int = 0  # trained tokens of the steps before a resume (rank 0: from the kept metrics)
    stopped_by: str | None = None  # an interrupted run: the signal or the time limit that stopped it

    @property
    def tokens(self) -> int:
        """Trained tokens of all steps done, over all ranks."""
        return self.tokens_before + sum(self.step_tokens)


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


def rank_batches(job: Job, rank: int, world: int):
    """The job's batches for this rank: rank 0 tokenizes (or checks) the data first and the other ranks then read
    its token shards (Note [token shards]): every rank tokenizing at once would run a pool per rank on the same
    cores. Rank 0's error is every rank's."""
    if world == 1:
        return job_batches(job, rank, world)
    batches, error = None, None
    if rank == 0:
        try:
            batches = job_batches(job, rank, world)
        except ConfigError as e:
            error = str(e)
        except Exception as e:  # the other ranks must not wait for data that will not come
            broadcast_object(f"rank 0 could not read the data ({type(e).__name__}: {e})", default_group())
            raise
    error = broadcast_object(error, default_group())
    if error is not None:
        raise ConfigError(error)
    return batches if rank == 0 else job_batches(job, rank, world)


def _open_run_dir(job: Job, resume: Resume | None, rank: int, world: int) -> RunDir:
    """The run directory, created (a new run) and locked by rank 0 (Note [run directory lock])."""
    run, error = None, None
    if rank == 0:
        try:
            run = RunDir.existing(resume.run_dir) if resume else RunDir.new(job.run.dir, job.run.name)
        except (ConfigError, OSError) as e:
            error = str(e) if isinstance(e, ConfigError) else (
                f"cannot create the run directory under run.dir = {job.run.dir!r} ({e}): choose another run.dir")
    path, error = broadcast_object((str(run.path) if run else None, error), default_group())
    if error:
        raise ConfigError(error)
    return run or RunDir(Path(path), created=False, fd=None)


def _make_dirs(config: Config, job: Job, run_dir: Path) -> None:
    from infinity.machine.preflight import prepare_nvme_paths
    prepare_nvme_paths(list(config.nvme.paths), job.created_swap(str(run_dir)))  # exit 2 naming a bad one
    if (run_dir / "swap").is_dir() and str(run_dir / "swap") in config.nvme.paths:
        os.chmod(run_dir / "swap", 0o700)  # the swap files hold the model's state: private to the job's user


def _run(job: Job, rank: int, world: int, verbose: bool, resume: Resume | None) -> Result:
    import infinity

    given = job.engine_keys.get("checkpoint", {}).get("dir")
    if given:  # Note [no silent keys]: the job saves where --resume finds them; the key would move only preflight
        raise ConfigError(f"checkpoint.dir = {show(given)}: infinity train saves its checkpoints in the run directory "
                          f"(<run>/checkpoint, <run>/checkpoints/); remove checkpoint.dir, and to put the run on "
                          f"another disk set run.dir there")
    check_installed(job.run.report_to)  # a tracker's package: before any work
    job, format_said = resolve_data_format(job)  # Note [data format from the records]
    batches = rank_batches(job, rank, world)  # bad data settings fail before any work
    run = _open_run_dir(job, resume, rank, world)
    run_dir, engine, say = run.path, None, None
    start = resume.step if resume else 0
    result = Result(run_dir=run_dir, status="starting", steps=start, losses=[], val_loss=None, seconds=0.0)
    # entered before the first step, left after the cleanup (Note [clean stop]); its deadline: Note [time limit]
    stop = StopFlag(parse_duration(job.run.time_limit, "run.time_limit"))
    sinks: tuple = ()
    try:
        config = job.engine_config(str(run_dir), start)
        _make_dirs(config, job, run_dir)
        say = Progress(job.run.steps, job.run.log_every, enabled=verbose and rank == 0, first_step=start,
                       last=rank == 0)
        earlier: list[float] = []
        if rank == 0 and resume is None:
            atomic_write(run_dir / "config.toml", to_toml(config, job, str(run_dir)))
        # the trackers before the model: one that cannot start (a login, a server) costs no work
        sinks = trackers(job.run.report_to, run_dir, to_toml(config, job, str(run_dir))) if rank == 0 else ()
        _measure_links(config, world)
        budgets = start_budgets(config, world)  # (the run's own estimate, at its end, plans with these)
        bundle = build_model(job.model, job.lora)
        engine = infinity.initialize(bundle.model, reserve_activations(job, config, world, torch.cuda.is_available()),
                                     init_fn=bundle.init_fn, weights=bundle.weights)
        if resume is not None:
            saved = engine.load_checkpoint(str(resume.checkpoint)).get("train", {})
            assert saved.get("step") == start, f"{resume.checkpoint} is at step {saved.get('step')}, not {start}"
            count_as_written(engine, [str(p) for step, p in run_checkpoints(run_dir) if step <= start],
                             start)  # the run's periodic and final ones (job steps are windows): keep_last goes on
            kept, kept_records = [], Earlier()  # rank 0's: the damaged checkpoints' new names, the kept metrics
            if rank == 0:  # only now: a resume that fails to start leaves the run's files as they were
                atomic_write(run_dir / "config.toml", to_toml(config, job, str(run_dir)))
                kept = set_aside(resume.damaged)  # kept, their steps saved again (Note [damaged checkpoint])
                kept_records = Metrics(run_dir).resumed(start)  # Note [metrics on resume]
                earlier, result.tokens_before = kept_records.losses, kept_records.tokens
            keep_profile_segments(config.profile.trace_dir, rank, int(os.environ.get("LOCAL_RANK", "0")),
                                  lambda: barrier(default_group()))  # Note [profile segments]
            if resume.damaged_note(kept):  # first the damage, then what it meant for the metrics
                say.final(resume.damaged_note(kept))  # (said under --quiet too: never a silent fallback)
            if kept_records.dropped:
                say.note(f"dropped {kept_records.dropped} metrics record(s) of steps after the checkpoint "
                         f"(step {start})")
            say.note(f"resuming {run_dir} at step {start} from {resume.checkpoint}")
            if resume.changes:
                say.note("changed from the run's config.toml: " + "; ".join(resume.changes))
            o = config.optimizer
            if o.schedule != "constant" and job.run.steps > o.total_steps:
                say.note(f"note: the learning rate reaches its final value at optimizer.total_steps = {o.total_steps} "
                         f"and stays there until run.steps = {job.run.steps}; --set optimizer.total_steps="
                         f"{job.run.steps} to stretch the schedule instead")
        for default in job.defaults():
            say.note(default.line())
        if format_said:
            say.note(format_said)
        say.note(f"{bundle.description}, {len(engine.units)} units, world size {world}, device {engine.device}, "
                 f"placement {_placement_text(engine)}; run directory {run_dir}")
        result.status = "running"  # from here on the run directory is the user's (Note [failed start])
        stop.install()
        with Metrics(run_dir if rank == 0 else None, sinks) as metrics:  # (it closes them from here on)
            sinks = ()
            ahead = BatchesAhead(batches, start, job.run.steps, config.train.grad_accum_steps, engine.device)
            try:  # (the batches built ahead of the step: Note [batches ahead])
                _loop(job, config, engine, bundle, ahead, stop, metrics, say, result,
                      elapsed_before=resume.elapsed_s if resume else 0.0)
            finally:
                stop.training = False
                ahead.close()
        result.losses = earlier + result.losses  # the whole run's (rank 0 reads the earlier ones from metrics.jsonl)
        _finish(job, config, engine, bundle, run_dir, result, world, rank, say, resume, budgets)
    except BaseException as e:
        for sink in sinks:  # made, not yet handed to the metrics: the tracker's run ends as failed
            sink.close(ok=False)
        if rank == 0 and result.status != "starting":
            summary = stopped_summary(run_dir, "aborted" if isinstance(e, KeyboardInterrupt) else "failed",
                                      result.steps, e)
            try:
                write_json(run_dir / "summary.json", summary)
                where = run_dir / "summary.json"
            except OSError as write_error:  # e.g. the disk is full: the message below is all there is
                where = f"summary.json not written: {write_error.strerror}"
            print(f"infinity train: {summary['status']} after {result.steps} steps: {summary['what_to_do']} "
                  f"({where})", file=sys.stderr, flush=True)
        raise
    finally:
        try:
            if engine is not None:
                engine.close()  # waits for in-flight I/O and removes this rank's swap files
                if say is not None:
                    _print_profile(engine, run_dir, say)
        finally:
            if say is not None:
                say.close()
            if result.status == "starting":
                run.discard()  # Note [failed start]
            else:
                run.release()
                swap_dir = run_dir / "swap"
                if swap_dir.is_dir() and not any(swap_dir.iterdir()):
                    shutil.rmtree(swap_dir, ignore_errors=True)
            stop.restore()
    return result


def _placement_text(engine) -> str:
    if engine.config.placement.policy == "static":
        return engine.plan.placement_text()  # (as the trainers say it: the tiers planned)
    return "auto (" + "; ".join(engine.plan.reasons[:3]) + ")"


def _measure_links(config: Config, world: int) -> None:
    """The auto policy plans with this machine's link rates: measure them once (local rank 0), then cached."""
    from infinity.machine.link_rates import link_rates
    if config.placement.policy == "auto" and config.nvme.paths:
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            link_rates(config.nvme.paths[0], io_config=config.io)
        barrier(default_group())


def _loop(job: Job, config: Config, engine, bundle: ModelBundle, ahead: BatchesAhead, stop: StopFlag,
          metrics: Metrics, say: Progress, result: Result, *, elapsed_before: float = 0.0) -> None:
    """Steps result.steps + 1 .. run.steps (> 0 when resuming: the batches and LR continue from there);
    `result` follows the steps done, so a run stopped by an error still reports where it was."""
    start, run_dir = result.steps, result.run_dir
    device, batches = engine.device, ahead.batches
    loss_of = batches.loss or bundle.loss  # samples carry their masked loss (Note [masked fine-tuning loss])
    began = time.perf_counter() - elapsed_before
    recent: list[float] = []
    overlap = None
    every = job.run.checkpoint_every
    part = getattr(engine, "profiler", None) or NullProfiler()  # the caller's parts of a step (Note [step attribution])
    for step in range(start + 1, job.run.steps + 1):
        t0 = time.perf_counter()
        total = torch.zeros((), dtype=torch.float64, device=device)
        with part.host("data"):
            # the window's trained tokens (not padding, not masked -100) over all ranks: each micro-batch's loss is
            # its summed loss over them (Note [token-weighted windows]), so the ranks' shares add up to the mean
            window, tokens_per_step = ahead.window(step - 1)
        for x, y in window:
            with part.host("data"):
                x, y = to_device(x, device), y.to(device, non_blocking=True)
            with part.host("loss"):
                loss = loss_of(engine, x, y, tokens_per_step)
            engine.backward(loss, num_items_in_batch=tokens_per_step)
            total += loss.detach().double()
        lr = lr_at(engine.optimizer_steps, config.optimizer)  # this window's update's (updates skipped not counted)
        applied = engine.step()
        with part.host("log"):  # (eval and checkpoint inside are named as such: Note [step attribution])
            stop.check_time(time.perf_counter() - t0, job.run.time_limit)  # Note [time limit]
            mean_loss, stopping = _reduce_step(total, stop.raised, device, engine.world_size)
            seconds = time.perf_counter() - t0
            recent = (recent + [seconds])[-10:]
            if step % job.run.log_every == 0 or step <= 2 or step == job.run.steps:
                overlap = overlap_efficiency(engine)  # summarizing the spans costs time: not every step
            record = {"step": step, "loss": mean_loss, "lr": lr,
                      "grad_norm": engine.last_grad_norm, "step_time_s": seconds,
                      "tokens_per_s": tokens_per_step / seconds, "tokens_per_step": tokens_per_step,
                      "tokens": result.tokens + tokens_per_step,
                      "elapsed_s": time.perf_counter() - began, "overlap_efficiency": overlap,
                      **memory_fields(engine.memory_report()),  # state bytes per tier, as the trackers get them
                      **({} if applied else {"skipped": True})}  # (fp16 overflow, train.on_nonfinite = "skip")
            if not math.isfinite(mean_loss):
                raise FloatingPointError(f"the loss is {mean_loss} at step {step}: lower optimizer.lr or raise "
                                         f"optimizer.warmup_steps")
            last = step == job.run.steps or stopping
            if job.run.eval_every and step % job.run.eval_every == 0 or last:
                with part.host("eval"):
                    result.val_loss = _validate(engine, bundle, batches, job.run.eval_batches, device)
                record["val_loss"] = result.val_loss
                say.note(f"step {step}: validation loss {result.val_loss:.4f}")
            metrics.record(record)
            result.steps, result.seconds = step, time.perf_counter() - began
            result.losses.append(mean_loss)
            result.step_tokens.append(tokens_per_step)
            say.update(step, mean_loss, tokens_per_step * len(recent) / sum(recent), overlap)
            if stopping:
                result.status = "interrupted"
                result.stopped_by = stop.reason or "another rank's stop"
                return
            if every and step % every == 0 and not last and job.run.checkpoint:  # the last step gets the final one
                with part.host("checkpoint"):
                    saving = time.perf_counter()
                    engine.save_checkpoint(str(run_dir / PERIODIC_CHECKPOINTS / f"step-{step:08d}"),
                                           user_state=train_position(job, config, step, time.perf_counter() - began,
                                                                     engine.world_size))
                    stop.save_s = time.perf_counter() - saving
    result.status = "completed"


def _reduce_step(loss: torch.Tensor, stop: bool, device: torch.device, world: int) -> tuple[float, bool]:
    """The sum of the ranks' losses, and whether any rank was asked to stop (Note [clean stop])."""
    if world == 1:
        return host_value(loss, "loss for the log"), stop
    import torch.distributed as dist
    packed = torch.stack([loss.double(), torch.tensor(float(stop), dtype=torch.float64, device=device)])
    dist.all_reduce(packed)  # every rank sees the same stop decision, so all stop after the same step
    packed = to_host(packed, "loss for the log and the stop flag")
    return float(packed[0]), bool(packed[1] > 0)


@torch.no_grad()
def _validate(engine, bundle: ModelBundle, batches: Batches, count: int, device: torch.device) -> float:
    engine.eval()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for x, y in batches.val_batches(count):
        total += (batches.loss or bundle.loss)(engine, x.to(device), y.to(device)).double()
    engine.train()
    value, _ = _reduce_step(total / count, False, device, engine.world_size)
    return value / engine.world_size  # (the mean of the ranks' batch means)


def _save_final(job: Job, config: Config, engine, run_dir: Path, result: Result, world: int, rank: int) -> Path:
    """The final checkpoint into <run>/checkpoint. A resumed run already has one: the new one is saved beside
    it and replaces it by renames; until the old one is removed both are complete, and `latest_checkpoint`
    takes the one with more steps (Note [resume])."""
    final = run_dir / FINAL_CHECKPOINT
    position = train_position(job, config, result.steps, result.seconds, world)
    replace = broadcast_object(final.exists(), default_group())
    target = run_dir / f"{FINAL_CHECKPOINT}.new-{result.steps:08d}" if replace else final
    if rank == 0 and target.exists():
        shutil.rmtree(target)  # left by a save that crashed while replacing; `final` is newer or as new
    barrier(default_group())
    engine.save_checkpoint(str(target), user_state=position)
    engine.wait_for_checkpoint()  # committed (visible, complete) before it replaces the old one
    if replace and rank == 0:
        old = run_dir / f"{FINAL_CHECKPOINT}.old-{result.steps:08d}"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():  # keep_last may have removed it (Note [a resumed run keeps its checkpoints in bounds])
            os.rename(final, old)
        os.rename(target, final)
        for stale in run_dir.iterdir():  # this one and any a crashed replacement left
            if stale.is_dir() and stale.name.startswith((f"{FINAL_CHECKPOINT}.old-", f"{FINAL_CHECKPOINT}.new-")):
                shutil.rmtree(stale, ignore_errors=True)
    barrier(default_group())
    return final


def _export(job: Job, engine, bundle: ModelBundle, run_dir: Path, checkpoint: Path | None, world: int,
            rank: int) -> Path:
    """<run>/export: the trained model as a Hugging Face directory, from the final checkpoint when there is one
    (else through a checkpoint of its own, removed after), with the pretrained directory's config and tokenizer
    files (Note [fine-tuning job])."""
    from infinity.state.export import copy_companions, export_checkpoint, resolve_export_dtype
    out = run_dir / EXPORT
    merge = job.lora.merge
    dtype = resolve_export_dtype(job.run.export_dtype, bundle.hf_config)  # Note [stand-alone export]
    if checkpoint is not None:
        if rank == 0:
            export_checkpoint(str(checkpoint), str(out), dtype=dtype, merge_lora=merge, model=engine.module,
                              config=bundle.hf_config, release=engine.heap.release)  # (Note [heap release])
        barrier(default_group())
    else:
        engine.export_state_dict(str(out), dtype=dtype, merge_lora=merge)  # config.json: the module's own
    if rank == 0:
        copy_companions(job.model.pretrained, str(out), adapters=bool(job.lora.r) and not merge)
    return out


def _print_profile(engine, run_dir: Path, say: Progress) -> None:
    """The profiler's table at the end of the job (written when the engine closes), as `infinity profile
    RUN_DIR` prints it."""
    profiled = getattr(engine, "profile_files", None) or {}
    if profiled.get("summary"):
        from infinity.profile.summary import format_summary
        with open(profiled["summary"]) as f:
            say.note(format_summary(json.load(f), last=10) + f"\n(`infinity profile {run_dir}` prints it again; "
                     f"timeline: {profiled.get('timeline', 'not drawn: matplotlib is not installed')})")


def _finish(job: Job, config: Config, engine, bundle: ModelBundle, run_dir: Path, result: Result, world: int,
            rank: int, say: Progress, resume: Resume | None = None, budgets=None) -> None:
    """Checkpoint, export, profile, memory report and summary (Note [clean stop]: also after an interrupt; the
    export only after a completed run); the run's estimate with the `budgets` of its start."""
    checkpoint = exported = None
    if job.run.checkpoint and hasattr(engine, "save_checkpoint"):
        checkpoint = _save_final(job, config, engine, run_dir, result, world, rank)
    if job.model.pretrained and job.run.export and result.status == "completed":
        exported = _export(job, engine, bundle, run_dir, checkpoint, world, rank)
    report = engine.memory_report()
    peaks = gather_object(peak_rss_bytes(), default_group())
    if rank != 0:
        return
    report["peak_rss_bytes_per_rank"] = peaks
    write_json(run_dir / "memory_report.json", report)
    summary = {
        "status": result.status, "steps": result.steps, "world_size": world,
        "first_loss": result.losses[0] if result.losses else None,
        "last_loss": result.losses[-1] if result.losses else None, "val_loss": result.val_loss,
        "seconds": result.seconds,
        "tokens_per_s": result.tokens / result.seconds if result.seconds else None,  # trained tokens, all ranks
        "trained_tokens_per_step": sum(result.step_tokens) / len(result.step_tokens) if result.step_tokens else None,
        "peak_rss_bytes": peaks[0], "checkpoint": str(checkpoint) if checkpoint else None,
        "export": str(exported) if exported else None,
        "overlap_efficiency": overlap_efficiency(engine),
    }
    if result.stopped_by:
        summary["stopped_by"] = result.stopped_by
    if resume is not None:
        summary["resumed"] = {"from": str(resume.checkpoint), "at_step": resume.step}
    estimate = run_estimate(job, config, world, say, budgets)
    if estimate is not None:
        write_json(run_dir / "estimate.json", estimate.to_json())
        from infinity.plan.estimate import predicted_vs_measured, predicted_vs_measured_line
        summary["predicted"] = predicted_vs_measured(estimate, peaks[0], Metrics(run_dir).step_seconds())
    write_json(run_dir / "summary.json", summary)
    say.close()
    if estimate is not None and predicted_vs_measured_line(summary["predicted"]):
        say.note(predicted_vs_measured_line(summary["predicted"]))  # (Note [estimate error])
    why = f" ({result.stopped_by})" if result.stopped_by else ""
    predicted = (summary.get("predicted") or {}).get("peak_rss_bytes")
    said = f" (predicted {predicted / 2**20:.0f} MiB)" if predicted else ""
    say.final(f"{result.status}{why} after {result.steps} steps in {result.seconds:.1f} s: loss "
              f"{summary['first_loss']:.4f} -> {summary['last_loss']:.4f}, validation {result.val_loss:.4f}; "
              f"peak RSS {peaks[0] / 2**20:.0f} MiB{said}; run directory {run_dir}"
              + (f"; exported to {exported}" if exported else ""))
