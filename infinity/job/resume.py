"""Resuming `infinity train` runs: the training position saved with every checkpoint, finding the
checkpoint to continue from, and loading the run's job for `--resume`.

Note [resume]: every checkpoint the job saves carries its training position in the
manifest's user state (`{"train": ...}`, written atomically with the checkpoint): the
steps done, the elapsed time, and what the batches depend on (data path, seed and split,
batch size, sequence length, accumulation) and the model. The batches are a pure function
of (data.seed, step, micro-batch) (Note [same batches at every world size] in data.py), so
the step *is* the data position; the LR schedule position is the engine's update counter,
restored by `load_checkpoint`. `--resume` takes the run's config.toml (or --config) plus
--set, refuses changes to the model or the batches (they would make the continuation differ
from the uninterrupted run; a pretrained directory that only moved is the same model: Note
[moved pretrained directory]), drops the metrics of steps after the checkpoint (a run killed
between checkpoints re-trains them), and continues in the same run directory. The final
checkpoint replaces the old `checkpoint/` by renames; `latest_checkpoint` picks the complete
checkpoint with the most steps, so a crash between those renames loses nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from infinity.config.options import ConfigError, parse_override, show
from infinity.config.sections import Config
from infinity.job.run_dir import refuse_if_in_use
from infinity.job.spec import Job, load_job
from infinity.models.build import TOKENIZER_IDENTITY_FILES
from infinity.state.checkpoint_load import verify

FINAL_CHECKPOINT = "checkpoint"  # <run>/checkpoint: the checkpoint saved at the end (or at Ctrl-C)
PERIODIC_CHECKPOINTS = "checkpoints"  # <run>/checkpoints/step-<N>: every run.checkpoint_every steps


@dataclass(frozen=True)
class Resume:
    """Where `infinity train --resume` continues (Note [resume])."""

    run_dir: Path
    checkpoint: Path
    step: int  # training steps done: the next batch is the one of this step index
    elapsed_s: float  # training time of the run so far
    damaged: tuple = ()  # (path, why) of newer checkpoints found damaged: set aside once the resume starts
    changes: tuple = ()  # "section.key: old -> new" for each engine key that differs from the run's config.toml

    def damaged_note(self, kept: list[Path]) -> str | None:
        """The line saying which damaged checkpoints were passed over and why, and the names `set_aside` gave
        them (`kept`, its answer) (Note [damaged checkpoint])."""
        if not self.damaged:
            return None
        what = "; ".join(f"{path} is {why}" if incomplete_save(path) else f"{path} is damaged ({why})"
                         for path, why in self.damaged)
        tried = len(self.damaged) + 1
        kept_said = (f"; the damaged one{'s' if len(kept) > 1 else ''} kept as {', '.join(str(p) for p in kept)}"
                     if kept else "")
        return (f"{what}: resuming from {self.checkpoint} (step {self.step}), the newest intact checkpoint of the "
                f"{tried} tried{kept_said}")


def train_position(job: Job, config: Config, step: int, elapsed_s: float, world: int) -> dict:
    """The user state saved with every checkpoint of the job (Note [resume])."""
    return {"train": {"step": step, "elapsed_s": elapsed_s, "world_size": world,
                      "model": job.model_identity(), "batches": _batch_keys(job, config),
                      "pretrained_files": pretrained_fingerprint(job.model.pretrained),
                      "data_files": data_fingerprint(job)}}


def data_fingerprint(job: Job) -> dict[str, str]:
    """Note [changed data file]: SHA-256 of the data files the batches are drawn from (data.path, data.val_path;
    not the shipped corpus). `--resume` refuses a file whose bytes changed since the checkpoint: the batches after
    it would not be the run's, and the run would mix two datasets without a word (its keys alone are the same).
    A directory or pattern (Note [data of several files]): "KEY:NAME" holds each file's, and KEY the SHA-256 of
    them all, so a file added, removed or changed is named."""
    from infinity.config.job import SHIPPED
    from infinity.data.sources import resolve
    from infinity.data.tokenized import file_sha256
    out = {}
    for key, path in (("data.path", job.data.path), ("data.val_path", job.data.val_path)):
        if not path or (path == SHIPPED and key == "data.path"):
            continue
        try:
            found = resolve(path, key)
        except ConfigError:  # (gone: the start names it)
            continue
        if not found.several:
            out[key] = file_sha256(found.files[0])
            continue
        files = {f"{key}:{found.name(f)}": file_sha256(f) for f in found.files}
        out[key] = hashlib.sha256(json.dumps(sorted(files.items())).encode()).hexdigest()
        out.update(files)
    return out


def _changed_files(saved: dict, now: dict, key: str) -> str:
    """Which of several files changed since the checkpoint (Note [changed data file]), as a clause."""
    names = lambda d: {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith(key + ":")}  # noqa: E731
    before, after = names(saved), names(now)
    said = [(what, sorted(n for n in group)) for what, group in (
        ("changed", {n for n in before.keys() & after.keys() if before[n] != after[n]}),
        ("added", after.keys() - before.keys()), ("removed", before.keys() - after.keys()))]
    return "; ".join(f"{what}: {', '.join(n[:5])}{' ...' if len(n) > 5 else ''}" for what, n in said if n)


# What a pretrained directory's model and tokens are, besides its weights (Note [moved pretrained directory])
PRETRAINED_IDENTITY_FILES = ("config.json", "generation_config.json", *TOKENIZER_IDENTITY_FILES)


def pretrained_fingerprint(directory: str) -> dict[str, str]:
    """SHA-256 of each of the directory's PRETRAINED_IDENTITY_FILES that exists ({} without a directory).

    Note [moved pretrained directory]: a run records `model.pretrained` as a path, and `--resume` refuses a
    change of the model; but a directory moved or copied elsewhere (another node, another disk) is the same
    model. So each checkpoint also records the hashes of the files that define the architecture and the
    tokens (the batches are tokenized with them), and `--resume --set model.pretrained=NEW` is accepted when
    NEW holds the same files, byte for byte. The weights are not hashed here: a checkpoint holds the trained
    ones, and the frozen ones it refers to are verified as they are read (Note [pretrained references])."""
    if not directory or not os.path.isdir(directory):
        return {}
    return {name: hashlib.sha256(Path(directory, name).read_bytes()).hexdigest()
            for name in PRETRAINED_IDENTITY_FILES if os.path.isfile(os.path.join(directory, name))}


def _moved_pretrained(position: dict, directory: str) -> str | None:
    """None when `directory` is the run's pretrained model moved (Note [moved pretrained directory]); else why not."""
    saved = position.get("pretrained_files")
    if not saved:
        return "the checkpoint records no hashes of its pretrained files (saved by an older infinity)"
    if not os.path.isdir(directory):
        return f"{directory} is not a directory"
    now = pretrained_fingerprint(directory)
    differ = sorted(name for name in set(saved) | set(now) if saved.get(name) != now.get(name))
    if not differ:
        return None
    return f"its {', '.join(differ)} {'differs' if len(differ) == 1 else 'differ'} from the run's"


def _batch_keys(job: Job, config: Config) -> dict:
    """The keys the sequence of training batches depends on (Note [same batches at every world size])."""
    return {"data.path": job.data.path, "data.seed": job.data.seed, "data.val_fraction": job.data.val_fraction,
            "run.batch_size": job.run.batch_size, "model.seq_len": job.model.seq_len,
            "train.grad_accum_steps": config.train.grad_accum_steps}


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every checkpoint directory the job may have written in `run_dir`, complete or not (not those set aside as
    damaged)."""
    out = [p for p in run_dir.iterdir() if p.is_dir() and (p.name == FINAL_CHECKPOINT
                                                           or p.name.startswith(FINAL_CHECKPOINT + "."))]
    periodic = run_dir / PERIODIC_CHECKPOINTS
    if periodic.is_dir():
        out += [p for p in periodic.iterdir() if p.is_dir()]
    return sorted(p for p in out if DAMAGED_SUFFIX not in p.name)


# Note [damaged checkpoint]: `--resume RUN` never goes back in silence. Its candidates are every checkpoint
# directory of the run. One whose manifest does not read (missing, truncated, unparsable, another format) is
# damaged; so is one whose manifest reads but whose files do not hold what it says (a rank file missing,
# truncated or overwritten, an index or RNG file changed: checkpoint_load.verify checks every record's CRC32, as
# the load does). It continues from the newest intact one and says which it passed over, why, and how many it
# tried (a line printed even with --quiet, before the one on the metrics records this drops); when none is
# intact the error lists every one. An incomplete save (`<name>.tmp-<token>` with its partial
# marker, left by a run stopped while saving) is never a candidate; it is named too, and the next save removes it
# as it removes every stopped save. `--resume RUN/checkpoints/step-N` is not refused for newer checkpoints that
# are damaged. The damaged ones are not deleted: once the resumed run has loaded its checkpoint they are renamed
# to <name>.damaged (the run will save those steps again under their names). The checkpoint format has no
# `latest` pointer to lose: the newest is found by the steps the manifests record.
DAMAGED_SUFFIX = ".damaged"


def incomplete_save(path: Path) -> bool:
    """A save a stopped run left (`<name>.tmp-<token>` with its partial marker): the next save removes it."""
    from infinity.state.checkpoint import PARTIAL_MARKER
    return ".tmp-" in path.name and (path / PARTIAL_MARKER).exists()


def set_aside(damaged) -> list[Path]:
    """Rename each damaged checkpoint to <name>.damaged (another suffix if that exists); returns the new paths."""
    moved = []
    for path, _ in damaged:
        if incomplete_save(path):
            continue  # an incomplete save: named, and removed by the next save as every stopped save is
        target, n = path.with_name(path.name + DAMAGED_SUFFIX), 1
        while target.exists():
            target, n = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}"), n + 1
        if path.exists():
            os.rename(path, target)
            moved.append(target)
    return moved


def keep_profile_segment(trace_dir: str) -> Path | None:
    """Note [profile segments]: before a resumed run profiles, the profile of the run so far (trace_dir's
    rank<N>/ directories) moves to trace_dir/segment-<its first step>/ (a suffix when that exists), so the new
    segment's files do not overwrite it; `infinity profile RUN` shows the newest segment and names the others.
    Returns the segment's directory, None when there was no profile."""
    base = Path(trace_dir)
    ranks = sorted(p for p in base.glob("rank*") if p.is_dir()) if base.is_dir() else []
    if not ranks:
        return None
    try:
        steps = json.loads((ranks[0] / "summary.json").read_text())["steps"]
        first = min(s["step"] for s in steps if s.get("step") is not None)
    except (OSError, ValueError, KeyError, TypeError):
        first = "unknown"  # (a profile cut short: kept all the same)
    target, n = base / f"segment-{first}", 1
    while target.exists():
        target, n = base / f"segment-{first}-{n}", n + 1
    target.mkdir()
    for rank in ranks:
        os.rename(rank, target / rank.name)
    return target


def keep_profile_segments(trace_dir: str, rank: int, local_rank: int, barrier) -> None:
    """Every rank's part of `keep_profile_segment` (Note [profile segments]): rank 0 moves the rank directories
    it sees; then, after `barrier()`, the first rank of each other node moves those its node still sees: none
    where the run directory is shared, the node's own where each node has its own disk."""
    if rank == 0:
        keep_profile_segment(trace_dir)
    barrier()
    if rank != 0 and local_rank == 0:
        keep_profile_segment(trace_dir)


def profile_segments(trace_dir: str) -> list[Path]:
    """The earlier segments' profiles kept in trace_dir (Note [profile segments]), oldest first."""
    base = Path(trace_dir)
    found = [p for p in base.glob("segment-*") if p.is_dir()] if base.is_dir() else []
    return sorted(found, key=lambda p: os.stat(p).st_mtime)


def _position_of(path: Path) -> dict | None:
    """The training position saved in the checkpoint at `path`; None when it is incomplete or not the job's."""
    from infinity.state.checkpoint import CheckpointError
    from infinity.state.checkpoint_load import read_manifest
    try:
        manifest = read_manifest(str(path))
    except (CheckpointError, OSError):
        return None
    position = (manifest.get("user_state") or {}).get("train")
    return position if isinstance(position, dict) and isinstance(position.get("step"), int) else None


def unreadable_checkpoints(run_dir: Path) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(path, why) of the checkpoint directories of `run_dir` whose manifest does not read, as two lists: the
    damaged ones (a manifest missing, truncated or unparsable, or of a format this version does not read) and
    the incomplete saves a stopped run left (`<name>.tmp-<token>` with its partial marker; the next save removes
    them). Neither is a candidate, and neither is passed over in silence (Note [damaged checkpoint])."""
    from infinity.state.checkpoint import CheckpointError
    from infinity.state.checkpoint_load import read_manifest
    damaged, partial = [], []
    for path in _checkpoint_dirs(run_dir):
        try:
            read_manifest(str(path))
        except (CheckpointError, OSError) as e:
            if incomplete_save(path):
                partial.append((path, "an incomplete save: the run stopped while writing it"))
            else:
                damaged.append((path, str(e)))
    return damaged, partial


def run_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(steps done, path) of the complete checkpoints `infinity train` saved in `run_dir`, oldest first."""
    found = [(pos["step"], path) for path in _checkpoint_dirs(run_dir) if (pos := _position_of(path)) is not None]
    return sorted(found, key=lambda sp: (sp[0], sp[1].name == FINAL_CHECKPOINT))


def latest_checkpoint(run_dir: Path) -> Path:
    """The complete checkpoint with the most steps in `run_dir`, or a ConfigError saying why there is none."""
    return newest_intact(run_dir, check=False)[0]


def newest_intact(run_dir: Path, check: bool = True) -> tuple[Path, list[tuple[Path, str]]]:
    """The complete checkpoint with the most steps in `run_dir` that verifies (Note [damaged checkpoint]), and
    (path, why) of the newer ones that do not; a ConfigError saying why there is none."""
    found = run_checkpoints(run_dir)
    damaged, partial = unreadable_checkpoints(run_dir) if check else ([], [])
    for _, path in reversed(found):
        why = verify(str(path)) if check else None
        if why is None:
            return path, damaged + partial
        damaged.append((path, why))
    if damaged:
        listed = "; ".join(f"{p} ({why})" for p, why in damaged + partial)
        raise ConfigError(f"--resume {run_dir}: every checkpoint of the run is damaged, {len(damaged + partial)} "
                          f"tried: {listed}. Start the run again with infinity train --config "
                          f"{run_dir / 'config.toml'} --set run.name=<new name>")
    others = [p.name if p.parent == run_dir else f"{p.parent.name}/{p.name}" for p in _checkpoint_dirs(run_dir)]
    why = (f"only {', '.join(others)}, which {'is' if len(others) == 1 else 'are'} incomplete (a save the run did not "
           f"finish) or not saved by infinity train" if others else
           "the run saved none: it had run.checkpoint = false, or stopped before its first checkpoint "
           "(run.checkpoint_every = N saves one every N steps)")
    raise ConfigError(f"--resume {run_dir}: no checkpoint found in {run_dir}: {why}. Start the run again with "
                      f"infinity train --config {run_dir / 'config.toml'} --set run.name=<new name>")


def load_resume(path: str | os.PathLike, config_path: str | os.PathLike | None = None,
                overrides: list[str] = ()) -> tuple[Job, Resume]:
    """The job and position of `infinity train --resume PATH` (a run directory, or one of its checkpoints).

    The job is the run's config.toml (or `config_path`) with `overrides`; keys that would change the model or
    the batches from the checkpoint on are refused, as is a checkpoint older than another one of the run.
    """
    given = Path(path).absolute()
    if not given.is_dir():
        raise ConfigError(f"--resume {path}: no such directory; give a run directory (runs/<name>, the one holding "
                          f"config.toml) or one of its checkpoints (runs/<name>/checkpoint)")
    damaged: list[tuple[Path, str]] = []
    run_dir = next((d for d in (given, given.parent, given.parent.parent) if (d / "config.toml").is_file()), None)
    if run_dir is None:
        raise ConfigError(f"--resume {path}: neither a run directory (no config.toml in it) nor a checkpoint "
                          f"inside one; give the directory infinity train created (runs/<name>)")
    refuse_if_in_use(run_dir)  # a live run (perhaps with no checkpoint yet): say so (Note [run directory lock])
    if run_dir == given:
        checkpoint, damaged = newest_intact(run_dir)
    else:
        from infinity.state.checkpoint_load import read_manifest
        read_manifest(str(given))  # a CheckpointError that says what is wrong with it
        checkpoint = given
        damaged = unreadable_checkpoints(run_dir)[0]  # (`given` read: not among them)
        why = verify(str(checkpoint))
        if why is not None:
            raise ConfigError(f"--resume {path}: the checkpoint is damaged ({why}); resume from the newest intact "
                              f"one with: infinity train --resume {run_dir}")
    position = _position_of(checkpoint)
    if position is None:
        raise ConfigError(f"--resume {path}: the checkpoint {checkpoint} has no training position (it was not saved "
                          f"by infinity train); load it with engine.load_checkpoint in your own loop")
    newer = [p for step, p in run_checkpoints(run_dir) if step > position["step"] and p not in dict(damaged)]
    for p in list(newer):  # a damaged newer checkpoint does not stand in the way (Note [damaged checkpoint])
        why = verify(str(p))
        if why is not None:
            damaged.append((p, why))
            newer.remove(p)
    if newer:
        raise ConfigError(f"--resume {path}: {len(newer)} checkpoint(s) of this run are newer than {checkpoint} "
                          f"(step {position['step']}), e.g. {newer[-1]}: resuming from it would overwrite them. "
                          f"Resume from the latest (--resume {run_dir}), or move the newer ones away first")
    for item in overrides:
        section, key, _ = parse_override(item)
        if section == "run" and key in ("dir", "name"):
            raise ConfigError(f"--set {item}: a resumed run continues in its own directory {run_dir}; drop it (to "
                              f"branch into a new run, copy the run directory and resume the copy)")
    job = load_job(config_path if config_path is not None else run_dir / "config.toml", overrides,
                   run_config=config_path is None)
    job = _relocate(job, run_dir)
    config = job.engine_config(str(run_dir))
    saved_model, saved_batches = position.get("model", {}), position.get("batches", {})
    for key, value in job.model_identity().items():
        if key == "pretrained" and value and saved_model.get(key) not in (None, value):
            why = _moved_pretrained(position, value)
            if why is not None:
                raise ConfigError(f"--resume {path}: model.pretrained = {show(value)}, but the checkpoint was trained "
                                  f"with model.pretrained = {show(saved_model[key])}, and {why}: point "
                                  f"model.pretrained at the run's pretrained directory, or at an unchanged copy of it")
            continue  # the same model, moved (Note [moved pretrained directory])
        if key in saved_model and saved_model[key] != value:
            raise ConfigError(f"--resume {path}: model.{key} = {show(value)}, but the checkpoint was trained with "
                              f"model.{key} = {show(saved_model[key])}: resume with the run's model (drop the "
                              f"--set or --config that changes it)")
    for key, value in _batch_keys(job, config).items():
        if key in saved_batches and saved_batches[key] != value:
            raise ConfigError(f"--resume {path}: {key} = {show(value)}, but the run trained with {key} = "
                              f"{show(saved_batches[key])}, so the batches after the checkpoint would differ from "
                              f"the run's: resume with the run's value (drop the --set or --config that changes it)")
    saved_data = position.get("data_files", {})
    now_data = data_fingerprint(job)
    for key in ("data.path", "data.val_path"):
        if key in saved_data and key in now_data and saved_data[key] != now_data[key]:
            which = _changed_files(saved_data, now_data, key)
            raise ConfigError(f"--resume {path}: {key} = {show(getattr(job.data, key.split('.')[1]))} has changed "
                              f"since the checkpoint ({which or 'its SHA-256 differs'}), so the batches after it "
                              f"would not be the run's: restore the run's file, or train a new run on the new "
                              f"data (infinity train --config {run_dir / 'config.toml'} --set run.name=<new name>)")
    from infinity.state.checkpoint_load import check_references
    check_references(str(checkpoint), job.model.pretrained or None)  # Note [pretrained references]: files still there
    if job.run.steps <= position["step"]:
        raise ConfigError(f"--resume {path}: the checkpoint is at step {position['step']} and run.steps = "
                          f"{job.run.steps}: nothing to train; --set run.steps=N with N > {position['step']} to "
                          f"train further")
    before = _relocate(load_job(run_dir / "config.toml", run_config=True), run_dir)
    before = before.engine_config(str(run_dir)).to_dict()
    derived, after = job.run_derived(str(run_dir)), config.to_dict()  # (the run's own paths and saves: not news)
    changes = tuple(f"{section}.{key}: {show(old)} -> {show(after[section][key])}"
                    for section, table in before.items() for key, old in table.items()
                    if after[section][key] != old and key not in derived.get(section, {}))
    return job, Resume(run_dir=run_dir, checkpoint=checkpoint, step=position["step"],
                       elapsed_s=float(position.get("elapsed_s", 0.0)), damaged=tuple(damaged), changes=changes)


def _relocate(job: Job, run_dir: Path) -> Job:
    """Drop the swap, profile and checkpoint paths config.toml resolved for the run directory (they may be relative to
    another working directory): the engine config then derives them from `run_dir` again."""
    written_for = os.path.join(job.run.dir, run_dir.name)  # the run directory's path when config.toml was written
    keys = {section: dict(table) for section, table in job.engine_keys.items()}
    if list(keys.get("nvme", {}).get("paths", ())) == [os.path.join(written_for, "swap")]:
        del keys["nvme"]["paths"]
    if keys.get("profile", {}).get("trace_dir") == os.path.join(written_for, "profile"):
        del keys["profile"]["trace_dir"]
    if keys.get("checkpoint", {}).get("dir") == written_for:
        del keys["checkpoint"]["dir"]
    return dataclasses.replace(job, engine_keys=keys)


# the error itself is printed after this line (by whoever catches it) and is summary.json's "error"
FIX_FIRST = "fix the error (printed next; \"error\" in summary.json), then "


def stopped_summary(run_dir: Path, status: str, steps: int, error: BaseException) -> dict:
    """summary.json of a run that stopped before its end: the error, and the checkpoint to continue from
    (none is named when the run has none: then its training is lost, and it says so)."""
    found = run_checkpoints(run_dir)
    message = str(error).strip() or type(error).__name__
    if found:
        step, path = found[-1]
        what = (f"the latest complete checkpoint is {path} (step {step}); "
                f"{FIX_FIRST if status == 'failed' else ''}continue with: "
                f"infinity train --resume {run_dir}")
    else:
        what = (f"this run has no complete checkpoint, so the {steps} step(s) it trained are lost; "
                f"{FIX_FIRST if status == 'failed' else ''}start again with: infinity train "
                f"--config {run_dir / 'config.toml'} --set run.name=<new name> (run.checkpoint_every = N saves "
                f"a checkpoint every N steps)")
    return {"status": status, "steps": steps, "error": message if status == "failed" else "stopped by a second "
            "Ctrl-C (or signal) before the clean stop finished", "checkpoint": str(found[-1][1]) if found else None,
            "what_to_do": what}
