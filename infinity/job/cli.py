"""The `infinity` command: train, estimate, config, bench-links, bench-io.

    infinity train [--config FILE] [--set key=value ...]
    infinity train --resume RUN_DIR_OR_CHECKPOINT [--set run.steps=N ...]   continue a run
    infinity estimate [--config FILE] [--model gpt|gpt2|llama|module:function] [--world-size N] [--explain]
    infinity estimate --stages [--world N] [--nodes M] [--hardware dgx2|dgx-h100] [--no-trace]
                                               every ZeRO stage: bytes per tier and link, step time
    infinity estimate --largest llama [--seq-len N]   the largest model that trains here (Note [largest model])
    infinity config --defaults                 every key with its default and meaning
    infinity config [--config FILE] [--set ...]  the resolved config of a job
    infinity profile RUN_DIR [--json] [--steps N]   the profile summary of a finished run (Note [profile command])
    infinity data prepare PATH [--tokenizer DIR] [--config FILE] [--set ...]   tokenize data ahead of a run
    infinity bench-links [--dir DIR] [--remeasure]   the link rates the auto policy uses (cached)
    infinity bench-io ...                      python -m io_engine.bench ...

Several processes: `torchrun --nproc-per-node N -m infinity train ...`.
Errors a user can fix (config, placement, preflight) print one message naming
the key and the fix, and exit with status 2; Ctrl-C during training exits 130
after the clean stop (see `infinity.job.train`, Note [clean stop]).

Note [closed stdout]: `infinity profile RUN --json | head -1` closes the pipe while the command still writes;
Python raises BrokenPipeError there, or at exit while flushing stdout. As a tool killed by SIGPIPE would, the
command stops quietly with status 141 (128 + SIGPIPE): main() flushes stdout itself, and on a BrokenPipeError
*of stdout* (the pipe's reader is gone: poll says so) points stdout at /dev/null so the exit's flush cannot
fail again. A BrokenPipeError of anything else (a socket between ranks) is raised as before.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import warnings

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_CLOSED_STDOUT = 141  # 128 + SIGPIPE, as a tool the signal ended (Note [closed stdout])


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="job file (TOML; JSON when it ends in .json): "
                                                    "engine sections plus [run], [model], [data]")
    p.add_argument("--set", dest="overrides", metavar="KEY=VALUE", action="append", default=[],
                   help="override one key, e.g. --set run.steps=500 --set placement.optimizer=host (repeatable)")
    p.add_argument("--deepspeed", metavar="DS_CONFIG", help="a DeepSpeed config (JSON) translated into infinity's "
                   "keys, read before --config and --set; the translation is printed (docs/from-deepspeed.md)")
    p.add_argument("--deepspeed-lenient", action="store_true", help="train without the DeepSpeed keys infinity "
                   "cannot honour (printed) instead of refusing them")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="infinity", description="Out-of-core ZeRO-3 training over GPU, RAM and NVMe.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="command")

    p = sub.add_parser("train", help="train a model (default: a small GPT on the shipped corpus)",
                       description="Train the job: with no arguments, a small byte-level GPT on "
                                   "infinity/corpus/kjv.txt.gz "
                                   "with parameters and optimizer state on NVMe under runs/<time>/swap.")
    _add_job_args(p)
    p.add_argument("--resume", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="continue a run from its latest checkpoint (or the checkpoint given): its config.toml "
                        "(unless --config) with --set applied, the same batches, LR schedule and metrics.jsonl")
    p.add_argument("--quiet", action="store_true", help="no progress output")

    p = sub.add_parser("estimate", help="bytes per tier, plan, step time and preflight checks, without running",
                       description="Predict a run of the job file: bytes per tier and kind, the placement plan "
                                   "with its reasons, the step time and traffic per link, and preflight checks.")
    _add_job_args(p)
    p.add_argument("--model", help='override model.kind ("gpt", "gpt2", "llama"), or "package.module:function" '
                                   "returning an nn.Module (called under infinity.meta_init())")
    p.add_argument("--world-size", "--world", type=int, default=1, metavar="N", help="ranks in the run (default 1)")
    p.add_argument("--nproc-per-node", type=int, default=None, metavar="M",
                   help="ranks per machine, sharing its RAM and disks (default: the world size)")
    p.add_argument("--stages", action="store_true",
                   help="every ZeRO stage x the configured placement: bytes per rank and tier, whether it fits, "
                        "collectives, bytes per link and the predicted step (docs/scaling.md)")
    p.add_argument("--nodes", type=int, default=None, metavar="M",
                   help="the world size spread over M nodes (implies --stages): network bytes split into intra- "
                        "and inter-node (Note [link model] in infinity/plan/scaling.py)")
    p.add_argument("--hardware", default=None, metavar="NAME",
                   help="price --stages on a preset node instead of this machine (implies --stages): "
                        "dgx2 | dgx-h100 (their budgets and link rates: docs/scaling.md)")
    p.add_argument("--no-trace", action="store_true",
                   help="with --stages: skip the meta forward/backward trace (count 6 FLOPs per parameter and token)")
    p.add_argument("--largest", metavar="FAMILY", default=None,
                   help="the largest model of FAMILY (llama) that trains on this machine with this job's budgets, "
                        "for full fine-tuning and for LoRA, with the plan for each (docs/estimate.md)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N", help="model.seq_len (tokens per sequence)")
    p.add_argument("--explain", action="store_true", help="the reason for every unit's tiers")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the link rates and the runtime memory again (else cached)")

    p = sub.add_parser("config", help="print every key with its default, or a job's resolved config")
    _add_job_args(p)
    p.add_argument("--defaults", action="store_true", help="every key at its default, with its meaning")

    p = sub.add_parser("profile", help="print the profile summary of a finished run",
                       description="The profiler's summary of a run made with profile.enabled = true: per step "
                                   "compute / exposed wait / overlap, and per link bytes, busy time, rate and "
                                   "exposed wait (medians).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<time>), its profile/ or profile/rankN")
    p.add_argument("--json", action="store_true", help="the summary.json of every rank")
    p.add_argument("--steps", type=_step_rows, default=10, metavar="N",
                   help="step rows to show, the last N (default 10; 0: none, only the median step and the links)")

    p = sub.add_parser("data", help="prepare a job's data ahead of a run (token shards, docs/data.md)")
    p = p.add_subparsers(dest="data_command", required=True, metavar="action").add_parser(
        "prepare", help="tokenize PATH once into the token shards a run reads (Note [token shards])",
        description="Tokenize PATH (data.path) with the tokenizer of DIR (model.pretrained; none: byte tokens) "
                    "into the cache a run with the same data settings reads; give the run's --config / --set "
                    "(data.format, model.seq_len, ...) so the key matches.")
    p.add_argument("path", metavar="PATH", help="the data (data.path): a file, a directory or a glob pattern")
    p.add_argument("--tokenizer", metavar="DIR", help="the pretrained model directory whose tokenizer the run uses")
    p.add_argument("--workers", type=int, default=None, metavar="N", help="tokenizing processes (default: a core "
                   "each for records and slow tokenizers, for inputs of 1 MiB or more)")
    _add_job_args(p)

    p = sub.add_parser("bench-links", help="measure (or show the cached) link rates used by the auto policy")
    p.add_argument("--dir", default=None, help="directory on the swap disk (default: the temp directory)")
    p.add_argument("--remeasure", action="store_true", help="measure again even when cached")
    p.add_argument("--json", action="store_true")

    sub.add_parser("bench-io", help="disk throughput of io_engine (python -m io_engine.bench)", add_help=False)
    return ap


def _step_rows(text: str) -> int:
    """`infinity profile --steps N`: a count of rows, 0 or more."""
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of steps: give 0 or more (e.g. --steps 20)")
    return count


def main(argv: list[str] | None = None) -> int:
    """The command; its exit status (Note [closed stdout]: a reader that went away ends it quietly)."""
    try:
        status = _command(argv)
        sys.stdout.flush()  # (a closed pipe shows here, not in the interpreter's flush at exit)
        if argv is None and sys.argv[1:2] == ["estimate"]:
            _skip_final_collection()
        return status
    except BrokenPipeError:
        if not _stdout_closed():
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush writes nowhere
        return EXIT_CLOSED_STDOUT


def _skip_final_collection() -> None:
    """When this process is `infinity estimate` (main() without argv: the console script, `python -m`), the
    interpreter's shutdown would collect garbage cycles over every object torch's import made: ~0.4 s of a ~3 s
    70B estimate. The objects alive now are moved out of the collector's reach (`gc.freeze`): the process's end
    frees them; the estimate leaves no files and nothing whose finalizer matters. (A caller of main(argv) in
    its own process keeps its collector as it was.)"""
    import gc
    gc.freeze()


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # (no fileno: stdout replaced by an object; no poll)
        return False


def _command(argv: list[str] | None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench-io"]:
        from io_engine import bench
        sys.argv = ["infinity bench-io", *argv[1:]]
        return bench.main() or 0
    args = build_parser().parse_args(argv)
    try:  # (torch loads in here, not before: a Ctrl-C while it loads is caught too, Note [light package import])
        return _run(args)
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run(args) -> int:
    from infinity.config.sections import SettingWarning
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_for(SettingWarning, f"infinity {args.command}: warning: ",
                                             warnings.showwarning)
        return _dispatch(args)


def _one_line_for(category, prefix: str, show):
    """A `warnings.showwarning` that prints warnings of `category` as one line (Note [inert setting]), each once
    (the job reads its config in more than one place), on the first rank only (torchrun's RANK: every rank plans
    the same run), others as `show` does."""
    said: set[str] = set()

    def one_line(message, cat, filename, lineno, file=None, line=None):
        if not issubclass(cat, category):
            return show(message, cat, filename, lineno, file, line)
        if os.environ.get("RANK", "0") == "0" and str(message) not in said:
            said.add(str(message))
            print(f"{prefix}{message}", file=sys.stderr if file is None else file)
    return one_line


def _dispatch(args) -> int:
    from infinity.config.sections import ConfigError
    from infinity.machine.preflight import PreflightError
    from infinity.memory.plan import PlacementError
    from infinity.state.checkpoint import CheckpointError
    from infinity.state.weights import WeightsError
    try:
        return {"train": _train, "estimate": _estimate, "config": _config, "bench-links": _bench_links,
                "profile": _profile, "data": _data}[args.command](args)
    except (ConfigError, PlacementError, PreflightError, CheckpointError, WeightsError) as e:  # bad input: exit 2
        print(f"infinity {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE


def _line(args):
    """The job this command line names (job/spec.py's JobLine): a DeepSpeed config's translation first (Note
    [deepspeed translation] in config/deepspeed.py), then the job file, then --set."""
    from infinity.job.spec import JobLine
    sets: tuple[str, ...] = ()
    if getattr(args, "deepspeed", None):
        from infinity.config import deepspeed
        t = deepspeed.translate(deepspeed.read(args.deepspeed), int(os.environ.get("WORLD_SIZE", "1")))
        if t.refused and not args.deepspeed_lenient:
            raise deepspeed.refusal(t, f"--deepspeed {args.deepspeed}")
        if os.environ.get("RANK", "0") == "0":  # (each command reads its line once: printed once)
            print("\n".join([f"deepspeed: {line}" for line in t.lines]
                            + [f"deepspeed: not honoured (--deepspeed-lenient): {line}" for line in t.refused]),
                  flush=True)
        sets = tuple(t.sets)
    return JobLine(args.config, sets + tuple(args.overrides))


def _train(args) -> int:
    from infinity.job.resume import load_resume
    from infinity.job.train import train
    line, resume = _line(args), None
    if args.resume:
        job, resume = load_resume(args.resume, line.config, list(line.sets))
    else:
        job = line.job()
    result = train(job, verbose=not args.quiet, resume=resume)
    return EXIT_INTERRUPTED if result.status == "interrupted" else 0


def _data(args) -> int:
    from infinity.data.tokenized import prepare
    from infinity.job.spec import JobLine
    line = _line(args)
    sets = (f"data.path={args.path}",) + ((f"model.pretrained={args.tokenizer}",) if args.tokenizer else ())
    for said in prepare(JobLine(line.config, line.sets + sets).job(), args.workers):
        print(said)
    return 0


def _config(args) -> int:
    from infinity.config.sections import Config
    from infinity.job.spec import job_defaults_text, to_toml
    if args.defaults:
        from infinity.job.spec import DECAY_DEFAULTS, TRAIN_DEFAULTS
        shown = {s: dict(t) for s, t in TRAIN_DEFAULTS.items()}
        shown["optimizer"].update(DECAY_DEFAULTS)
        print(Config.defaults_text(commented=True, values=shown, header=(
            "# infinity train: every engine key, commented out (a copy of this file changes nothing: uncomment what\n"
            "# you set), at infinity train's defaults where they differ from the engine's. Some are derived from\n"
            "# the job when unset (warmup_steps, total_steps, a pretrained model's fine-tuning lr, nvme.paths,\n"
            "# profile.trace_dir): set one and it is fixed.")))
        print(job_defaults_text())
        return 0
    from infinity.data.tokenized import resolve_data_format
    job, _ = resolve_data_format(_line(args).job())  # the format the run reads: its output trains as it says
    run_dir = os.path.join(job.run.dir, "<run>")
    print(to_toml(job.engine_config(run_dir), job, run_dir))
    return 0


def _estimate(args) -> int:
    from infinity.config.sections import ConfigError
    from infinity.plan import estimate as est
    line = _line(args).then(*([f"model.seq_len={args.seq_len}"] if args.seq_len is not None else []))
    custom = None
    if args.model and ":" in args.model:
        custom = args.model
    elif args.model:
        line = line.then(f'model.kind="{args.model}"')
    if args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be >= 1")
    if args.largest is not None:
        return _largest(args, line, custom)
    result = _job_estimate(args, line, custom)
    if result is None:
        return 0
    if args.json:
        print(json.dumps(result.to_json(), indent=1, default=str))
    else:
        print(est.format_estimate(result, explain=args.explain))
    return 0 if result.ok else 1


def _largest(args, line, custom) -> int:
    """Note [largest model]: bisect the family's ladder, each rung judged by the estimate of this job."""
    from infinity.config.sections import ConfigError
    from infinity.plan import largest
    if args.largest not in largest.LADDERS:
        raise ConfigError(f"--largest {args.largest}: not a model family; one of {', '.join(largest.LADDERS)}")
    if custom or args.stages or args.nodes or args.hardware:
        raise ConfigError("--largest searches a family's shapes on this machine: drop --model module:function, "
                          "--stages, --nodes and --hardware")
    seq_len = line.job().model.seq_len
    answers = largest.run(args.largest, seq_len, lambda sets: _job_estimate(args, line.then(*sets), None, plans=1))
    if args.json:
        print(json.dumps([{"mode": a.mode, "judged": a.judged, **{k: None if v is None else {
            "rung": v.rung.name, "shape": dataclasses.asdict(v.rung), "num_params": v.estimate.num_params,
            "set": v.plan, "fits": v.fits, "step_s": v.row.step_s if v.row is not None else None,
            **dict(zip(("state_bytes", "free_bytes"), v.share()))} for k, v in (("largest", a.largest),
                                                                                  ("above", a.above))}}
                          for a in answers], indent=1))
    else:
        print(largest.format_answers(args.largest, seq_len, answers))
    return 0 if all(a.largest is not None for a in answers) else 1


def _job_estimate(args, line, custom, plans: int = 3):
    """The Estimate of the job `line` names (None when --stages printed its own report); `plans`: how many."""
    from infinity.config.sections import ConfigError
    from infinity.models.build import build_model
    from infinity.plan import estimate as est
    job = line.job()
    run_dir = os.path.join(job.run.dir, "<run>")
    config = job.engine_config(run_dir)
    from infinity.machine.preflight import check_nvme_paths
    check_nvme_paths(list(config.nvme.paths), created_at_start=job.created_swap(run_dir))  # exit 2: Note [nvme paths]
    make = (lambda: _custom_model(custom)) if custom else (lambda: build_model(job.model, job.lora))
    if job.run.batch_size % args.world_size:
        raise ConfigError(f"run.batch_size = {job.run.batch_size} is not divisible by --world-size "
                          f"{args.world_size}: set run.batch_size to a multiple of it")
    if args.stages or args.nodes or args.hardware:
        _estimate_stages(args, make, config, job)
        return None

    def apply(sets: list[str]):
        """The job with a plan's `--set` lines after the user's, loaded and checked as `infinity train` would."""
        from infinity.plan.search import Applied
        planned = line.then(*sets).job()
        if planned.run.batch_size % args.world_size:
            raise ConfigError(f"run.batch_size = {planned.run.batch_size} is not divisible by --world-size "
                              f"{args.world_size}")
        return Applied(planned.engine_config(os.path.join(planned.run.dir, "<run>")),
                       planned.run.batch_size // args.world_size)
    from infinity.job.prediction import estimate_inputs
    from infinity.plan.traced import job_depth
    inputs = estimate_inputs(job, config, args.world_size, _imported_by(make) if custom else None)
    return est.estimate(make, config, world_size=args.world_size, local_world_size=args.nproc_per_node,
                        batch_size=job.run.batch_size // args.world_size, seq_len=job.model.seq_len,
                        remeasure=args.remeasure, apply=apply,
                        lora=_lora_option(job, custom, line, not config.activation.loss_chunk_tokens),
                        depth=None if custom else job_depth(job.model, job.lora,
                                                            own_llama=not config.activation.loss_chunk_tokens),
                        plans=plans, **inputs)


def _lora_option(job, custom, line, own_llama: bool):
    """For a pretrained model trained whole: the `--set` line that trains LoRA adapters instead, and its model."""
    if custom or not job.model.pretrained or job.lora.r:
        return None
    from infinity.models.build import build_model
    from infinity.plan.traced import job_depth
    sets = ["model.lora.r=16"]
    lora_job = line.then(*sets).job()
    return sets, lambda: build_model(lora_job.model, lora_job.lora), job_depth(lora_job.model, lora_job.lora,
                                                                                  own_llama=own_llama)


def _estimate_stages(args, make, config, job) -> int:
    from infinity.config.sections import ConfigError
    from infinity.plan import scaling
    nodes = args.nodes or 1
    if args.nproc_per_node and args.nproc_per_node * nodes != args.world_size:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} x --nodes {nodes} != --world-size "
                          f"{args.world_size}: give two of them")
    if args.nproc_per_node and not args.nodes:
        nodes = max(1, args.world_size // args.nproc_per_node)
    hardware = None
    if args.hardware:
        if args.hardware not in scaling.HARDWARE:
            raise ConfigError(f"--hardware {args.hardware}: not a preset; one of {', '.join(scaling.HARDWARE)}")
        hardware = scaling.HARDWARE[args.hardware]
    cluster = scaling.Cluster(args.world_size, nodes)
    report = scaling.estimate_stages(make, config, cluster, hardware=hardware,
                                     batch_size=job.run.batch_size // args.world_size, seq_len=job.model.seq_len,
                                     trace=not args.no_trace)
    if args.json:
        print(json.dumps(report.to_json(), indent=1, default=str))
    else:
        print(scaling.format_stages(report))
    return 0


def _imported_by(make) -> tuple[str, ...]:
    """The modules building a `--model module:function` model imports beyond torch and infinity (what the run's
    process will hold: the estimate's runtime probe imports them too)."""
    before = set(sys.modules)
    make()
    return tuple(sorted(m for m in set(sys.modules) - before if m.split(".")[0] not in ("torch", "infinity")))


def _custom_model(spec: str):
    """`package.module:function` -> a ModelBundle of the nn.Module it returns, built on the meta device."""
    import torch.nn as nn

    from infinity.config.sections import ConfigError
    from infinity.models.build import ModelBundle
    from infinity.runtime.materialize import meta_init
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--model {spec}: cannot load it ({e}); give package.module:function, importable from "
                          f"the current directory or sys.path") from None
    with meta_init():
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"--model {spec}: returned {type(model).__name__}, expected an nn.Module")
    return ModelBundle(model, None, _generic_loss, spec)


def _generic_loss(forward, x, y):
    """Cross-entropy of whatever the model returns for token ids: a loss, logits, or an output with .logits."""
    import torch
    import torch.nn.functional as F
    out = forward(x)
    logits = getattr(out, "logits", out)
    if isinstance(logits, torch.Tensor) and logits.dim() == 3:
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))
    out = forward(x, y)
    return out if isinstance(out, torch.Tensor) else out.loss


def profile_summaries(run_dir: str) -> dict[str, dict]:
    """Note [profile command]: the profiler's summary.json of every rank of a run, by rank directory name:
    RUN_DIR/profile/rank<N>/summary.json (the job's layout, profile.trace_dir), or a profile directory
    itself, or one rank's directory. A ConfigError names what is missing and how to get it."""
    from infinity.config.sections import ConfigError
    if os.path.isfile(run_dir):
        raise ConfigError(f"infinity profile {run_dir}: a file; give a directory: a run directory (runs/<time>), "
                          f"its profile/ or profile/rank<N>, or an HF Trainer's output_dir; here probably "
                          f"`infinity profile {_enclosing_run(run_dir)}`")
    found: dict[str, dict] = {}
    for base in (os.path.join(run_dir, "profile"), run_dir):
        if os.path.isdir(base):
            for name in sorted(os.listdir(base)):
                path = os.path.join(base, name, "summary.json")
                if name.startswith("rank") and os.path.isfile(path):
                    with open(path) as f:
                        found[name] = json.load(f)
        if found:
            return found
    path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
        if "median" in data and "steps" in data:
            return {f"rank{data.get('rank', 0)}": data}
    if not os.path.exists(run_dir):
        raise ConfigError(f"infinity profile {run_dir}: no such directory; give a run directory (runs/<time>)")
    if _trainer_output(run_dir):
        raise ConfigError(f"{run_dir} has no profile (profile/rank<N>/summary.json): the trainer ran without the "
                          f"profiler; pass infinity_config={{\"profile\": {{\"enabled\": True}}}} to InfinityTrainer / "
                          f"InfinitySFTTrainer (or [profile] enabled = true in its TOML file): the profile is then "
                          f"written to output_dir/profile")
    raise ConfigError(f"{run_dir} has no profile (profile/rank<N>/summary.json): the run was made without the "
                      f"profiler; train with --set profile.enabled=true")


def _enclosing_run(path: str) -> str:
    """The run directory a file lies in: the nearest directory above it with a profile/ or a config.toml (the
    job's), else the file's own directory."""
    directory = os.path.dirname(os.path.abspath(path))
    while True:
        if os.path.isdir(os.path.join(directory, "profile")) or os.path.isfile(os.path.join(directory, "config.toml")):
            return os.path.relpath(directory) if not os.path.isabs(path) else directory
        parent = os.path.dirname(directory)
        if parent == directory:
            return os.path.dirname(path) or "."
        directory = parent


def _trainer_output(path: str) -> bool:
    """A Hugging Face Trainer's output_dir (or one of its checkpoint-N folders), not a job's run directory."""
    if os.path.isfile(os.path.join(path, "config.toml")):
        return False  # the job's
    return any(os.path.exists(os.path.join(path, name)) for name in ("training_args.bin", "trainer_state.json")) \
        or any(name.startswith("checkpoint-") for name in os.listdir(path) if os.path.isdir(os.path.join(path, name)))


def _profile(args) -> int:
    from infinity.profile.summary import format_summary
    summaries = profile_summaries(args.run_dir)
    if args.json:
        print(json.dumps(summaries, indent=1))
        return 0
    print("\n\n".join(format_summary(s, last=args.steps) for s in summaries.values()))
    from infinity.job.resume import profile_segments
    profile_dir = os.path.join(args.run_dir, "profile")
    segments = profile_segments(profile_dir if os.path.isdir(profile_dir) else args.run_dir)
    if segments:  # Note [profile segments]: the run was resumed; the profiles of its earlier segments
        print("the profiles of the run's earlier segments (before each resume): "
              + ", ".join(f"infinity profile {p}" for p in segments))
    return 0


def _bench_links(args) -> int:
    from infinity.machine.link_rates import cache_path, link_rates
    rates = link_rates(args.dir, remeasure=args.remeasure)
    if args.json:
        print(json.dumps(rates.to_json(), indent=1))
        return 0
    gb = 1e9
    print(f"link rates ({rates.source}; cache {cache_path()}):")
    print(f"  nvme read   {rates.nvme_read / gb:8.2f} GB/s")
    print(f"  nvme write  {rates.nvme_write / gb:8.2f} GB/s")
    for name in ("h2d", "d2h"):
        value = getattr(rates, name)
        print(f"  {name:11} " + ("    none (no GPU)" if value == float("inf") else f"{value / gb:8.2f} GB/s"))
    print(f"  cpu adam    {rates.cpu_adam / 1e9:8.2f} G elements/s")
    print(f"  device adam {rates.device_adam / 1e9:8.2f} G elements/s")
    print(f"  matmul      {rates.matmul_flops / 1e12:8.3f} TFLOP/s")
    print(f"  elementwise {rates.memory_bw / gb:8.2f} GB/s (bytes read and written)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
