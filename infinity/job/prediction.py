"""What a training job predicts of its own run: the activations "auto" tail units reserve (traced before the
engine is made), the estimate's inputs beyond the model and the config (also `infinity estimate`'s), and the
estimate the run is compared with at its end (summary.json's "predicted": Note [estimate error])."""

from __future__ import annotations

import dataclasses
import warnings

import torch

from infinity.config.sections import Config, SettingWarning
from infinity.data.tokenized import reader_modules, resident_bytes
from infinity.job.progress import Progress
from infinity.job.spec import Job
from infinity.memory.placement import reserves_activations
from infinity.memory.plan import Budgets
from infinity.models.build import build_model, runtime_modules


def reserve_activations(job: Job, config: Config, world: int, cuda: bool) -> Config:
    """`config` with `memory.activation_reserve` at the traced activations of a micro-batch, where "auto" tail
    units would otherwise guess half the free device memory for them (Note [tail units]: on a GPU, both "auto"),
    and the auto policy would leave them none (Note [auto placement]): a plan that fits without them then fits
    with them, the plan `infinity estimate` makes. The run's config.toml keeps "auto"."""
    if not reserves_activations(config, cuda) or config.memory.activation_reserve != "auto":
        return config
    from infinity.plan import estimate as est
    from infinity.plan.traced import job_depth
    try:
        acts = est.traced_activations(lambda: build_model(job.model, job.lora), config,
                                      batch_size=job.run.batch_size // world, seq_len=job.model.seq_len,
                                      depth=job_depth(job.model, job.lora,
                                                      own_llama=not config.activation.loss_chunk_tokens))
    except Exception as e:  # noqa: BLE001 - the run goes on with the engine's own rule, and says so
        warnings.warn(f"the activations could not be traced ({type(e).__name__}: {e}): \"auto\" tail units keep "
                      f"half of the free device memory for them, the auto policy none; set "
                      f"memory.activation_reserve to a size (`infinity estimate` shows the activations) or "
                      f"placement.tail_units to a count", SettingWarning, stacklevel=2)
        return config
    return dataclasses.replace(config, memory=dataclasses.replace(config.memory, activation_reserve=acts))


def estimate_inputs(job: Job, config: Config, world: int, model_modules: tuple[str, ...] | None = None) -> dict:
    """What the estimate of this job's run takes beyond the model and the config (for `infinity estimate` and the
    run's own): the runtime probe's modules, the model's (`model_modules`, default models/build.py's) and its data
    reader's (Note [peak memory] runtime), and the data pipeline's terms of one rank (Note [data in the estimate])."""
    model = runtime_modules(job.model, job.lora) if model_modules is None else model_modules
    return {"runtime_modules": model + reader_modules(job),
            "data": resident_bytes(job, world, config.train.grad_accum_steps, cuda=torch.cuda.is_available())}


def start_budgets(config: Config, world: int) -> Budgets:
    """The budgets `infinity estimate` resolves on this machine, taken before the run holds any memory or disk:
    its own estimate, made after training (Note [estimate error]), plans with them. Resolved then, they would
    leave out the run's own swap files and RAM: a run that took most of the disk got no prediction at all (a
    3.7B Llama whose 41 GiB of swap left 1.7 GiB free, 2026-11-28)."""
    from infinity.machine.preflight import check_disks
    from infinity.plan import estimate as est
    _, nvme_free = check_disks(list(config.nvme.paths), nvme_bytes=0, local_world_size=world,
                               headroom=config.memory.headroom)
    return est.resolve_budgets_for(config, local_world_size=world, cuda=torch.cuda.is_available(),
                                   nvme_free=nvme_free, check_machine=world == 1)


def run_estimate(job: Job, config: Config, world: int, say: Progress, budgets: Budgets | None = None):
    """What `infinity estimate` predicts for this run (run after training, so it does not add to the
    measured peak memory), with the `budgets` of the run's start (`start_budgets`)."""
    from infinity.plan import estimate as est
    from infinity.plan.traced import job_depth
    try:  # (as `infinity estimate` makes it: the same figures, without torch._dynamo's import: Note [small twin])
        return est.estimate(lambda: build_model(job.model, job.lora), config, world_size=world,
                            batch_size=job.run.batch_size // world, seq_len=job.model.seq_len, budgets=budgets,
                            depth=job_depth(job.model, job.lora, own_llama=not config.activation.loss_chunk_tokens),
                            **estimate_inputs(job, config, world))
    except Exception as e:  # noqa: BLE001 - a failed prediction must not fail a finished run
        say.note(f"(no estimate: {type(e).__name__}: {e})")
        return None
