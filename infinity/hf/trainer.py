"""`transformers.Trainer` and TRL's `SFTTrainer` running on the infinity engine (docs/hf-trainer.md).

    trainer = InfinityTrainer(model=model, args=args, train_dataset=ds, infinity_config="run.toml")

The Trainer keeps its loop (data, callbacks, logging, evaluation, checkpoint folders, the LR scheduler);
the engine owns the model's state. Note [trainer on the engine]: as optimum-neuron / optimum-habana do,
the subclass replaces the few places where the Trainer touches parameters, gradients or the optimizer:
- the engine is built in `__init__` (so `evaluate()` before `train()` works, and a model built under
  `infinity.meta_init()` is materialized from `infinity_weights=` unit by unit, never whole in RAM);
- `create_optimizer` returns `engine.optimizer` (the Trainer's decay / no-decay groups were given to the
  engine as `param_groups=`), so the Trainer's own `create_scheduler` drives the engine's lrs;
- `_wrap_model` returns `EngineForward`, a module whose forward is `engine(...)`: `compute_loss`,
  `prediction_step` (under no_grad) and TRL's losses call it unchanged, and Accelerate never wraps the
  model (no DDP: the engine reduces gradients itself);
- `training_step` ends in `engine.backward` instead of `accelerator.backward`;
- clipping is the engine's (`[optimizer] grad_clip` = max_grad_norm, applied inside `engine.step()`);
  the grad norm the Trainer logs is the engine's, filled in after the step;
- `save_model` writes the engine's HF export (a PEFT model's adapters as PEFT writes them: Note [adapter
  directory] in state/export.py); `_save_optimizer_and_scheduler` /
  `_load_optimizer_and_scheduler` write / read an engine checkpoint (bitwise resume); `_load_from_checkpoint`
  does nothing (the weights come back with the engine checkpoint).
Private methods overridden (`_wrap_model`, `_move_model_to_device`, `_clip_grad_norm`, `_get_grad_norm`,
`_save_optimizer_and_scheduler`, `_load_optimizer_and_scheduler`, `_load_from_checkpoint`) are pinned by
the transformers range in pyproject.toml's `hf` extra.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from infinity.config.sections import ConfigError
from infinity.device.dtypes import name_of
from infinity.hf.arguments import engine_config_for
from infinity.runtime.engine import initialize

__all__ = ["EngineForward", "InfinityTrainer", "InfinityTrainerMixin", "ModelOptimizer", "run_line"]

ENGINE_CHECKPOINT = "infinity"  # the engine checkpoint inside a Trainer checkpoint-N folder
SCHEDULER_FILE = "scheduler.pt"  # (transformers' SCHEDULER_NAME)
OPTIMIZER_FILE = "optimizer.pt"  # (transformers' OPTIMIZER_NAME)


class EngineForward(nn.Module):
    """The model as the Trainer calls it: forward = `engine(...)`; holds no parameters of its own (so the
    Trainer's `model.zero_grad()` touches nothing: the engine owns the gradients)."""

    def __init__(self, engine, model=None):
        super().__init__()
        self.engine = engine  # (not a submodule: its parameters are the engine's)
        # the user's model, apart from the engine's module: its train / eval mode follows the engine's, as TRL
        # reads `self.model.training` (Note [the user's model])
        self._user = [model] if model is not None and model is not engine.module else []

    def forward(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def generate(self, *args, **kwargs):
        """The model's own `generate` on the engine (trainers that sample from the wrapped model: GRPO, a
        Seq2SeqTrainer's predict_with_generate)."""
        return self.engine.generate(*args, **kwargs)

    def train(self, mode: bool = True) -> "EngineForward":
        super().train(mode)
        self.engine.train(mode)
        for model in self._user:
            model.train(mode)
        return self

    @property
    def config(self):
        return self.engine.module.config


class _GroupView(MutableMapping):
    """One of the engine's parameter groups as `trainer.optimizer` shows it (Note [the Trainer's optimizer])."""

    def __init__(self, group: dict, params: list):
        self._group, self._params = group, params

    def __getitem__(self, key):
        return self._params if key == "params" else self._group[key]

    def __setitem__(self, key, value):
        if key == "params":
            raise ValueError("trainer.optimizer.param_groups[i][\"params\"]: the groups are fixed when the engine "
                             "is built (the Trainer's decay / no-decay split)")
        self._group[key] = value

    def __delitem__(self, key):
        del self._group[key]

    def __iter__(self):
        return iter(self._group)

    def __len__(self):
        return len(self._group)

    def __repr__(self):
        return repr({k: (f"<{len(self._params)} parameters>" if k == "params" else v) for k, v in self.items()})


# Note [the Trainer's optimizer]: `trainer.optimizer` is the engine's optimizer as transformers' Trainer shows its
# own: `step()` is `engine.step()` (through engine.optimizer), and `param_groups[i]["params"]` are the user's model's
# parameters (`trainer.get_optimizer_group(param)`, code that counts or inspects them), while every other key of a
# group is the engine's group's own (a scheduler's lr writes are the engine's learning rates). The engine's groups
# hold parameter names (its checkpoints record them), so the Trainer gets views of them, not the dicts.
class ModelOptimizer(torch.optim.Optimizer):
    """`trainer.optimizer`: engine.optimizer with the model's parameters in its groups (Note [the Trainer's
    optimizer])."""

    def __init__(self, engine_optimizer, model: nn.Module):
        super().__init__([{"params": []}], dict(engine_optimizer.defaults))
        by_name = dict(model.named_parameters())
        self.engine_optimizer = engine_optimizer
        self.param_groups = [_GroupView(g, [by_name[n] for n in g["params"]]) for g in engine_optimizer.param_groups]

    def add_param_group(self, param_group: dict) -> None:
        if hasattr(self, "engine_optimizer"):
            self.engine_optimizer.add_param_group(param_group)  # (refused there, with the reason)
        self.param_groups.append(param_group)  # (torch's __init__'s placeholder, replaced at once)

    def step(self, closure=None):  # noqa: D102 - torch's signature
        return self.engine_optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        """Nothing to do: the engine's gradients are consumed by its update."""

    def state_dict(self) -> dict:  # noqa: D102
        return self.engine_optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:  # noqa: D102
        self.engine_optimizer.load_state_dict(state_dict)


class _SayWhatRuns(TrainerCallback):
    """At the start of train(), rank 0 prints one line of what the engine runs (`run_line`); at its end the
    profile is written (output_dir/profile unless infinity_config sets profile.trace_dir)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        if self.trainer.is_world_process_zero():
            print(run_line(args, self.trainer.engine), flush=True)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.engine.write_profile()  # (with [profile] enabled: `infinity profile OUTPUT_DIR` reads it)


def run_line(args, engine) -> str:
    """What the engine runs, read from its plan and config (the values in use), and where the Trainer decided
    them (Note [training arguments win] in arguments.py)."""
    plan, cfg = engine.plan, engine.config
    clip = cfg.optimizer.grad_clip
    auto = " (auto)" if cfg.placement.policy == "auto" else ""
    return (f"infinity: compute {name_of(plan.compute_dtype)} (from {type(args).__name__} bf16={args.bf16}), "
            f"placement {plan.placement_text()}{auto}, ZeRO stage {cfg.zero.stage}, grad clipping "
            f"{f'at norm {clip:g}' if clip > 0 else 'off'} (max_grad_norm={args.max_grad_norm}), optimizer "
            f"{cfg.optimizer.name} state {plan.state_dtype.value}, world size {engine.world_size}, "
            f"device {engine.device}")


class _GradNormLog(TrainerCallback):
    """After each optimizer step, the engine's global grad norm into the tensor the Trainer logs."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kwargs):
        norm = self.trainer.engine.last_grad_norm
        if norm is not None:
            self.trainer._grad_norm.fill_(norm)


def _name_the_base(model, weights) -> None:
    """A PEFT model built under meta_init has no base name for its adapter_config.json: the directory of
    `infinity_weights=` is its base model (Note [adapter directory] in state/export.py)."""
    for config in (getattr(model, "peft_config", None) or {}).values():
        if not config.base_model_name_or_path and isinstance(weights, (str, os.PathLike)) and os.path.isdir(weights):
            config.base_model_name_or_path = os.path.abspath(weights)


def _refuse_own_optimizer(optimizers, optimizer_cls_and_kwargs) -> None:
    """`optimizers=(optimizer, scheduler)` / `optimizer_cls_and_kwargs=`: the engine's optimizer is its own (AdamW
    over its shards, state on its tiers); a torch optimizer over the model's parameters would never see a gradient."""
    if optimizers is not None and any(o is not None for o in optimizers):
        raise ConfigError("InfinityTrainer(optimizers=...): the engine runs its own AdamW over its shards (state on "
                          "its tiers), so an optimizer built on the model would never step; set learning_rate, "
                          "adam_beta1/2, adam_epsilon and weight_decay in TrainingArguments, and lr_scheduler_type "
                          "(or override create_scheduler to build a torch scheduler on trainer.optimizer)")
    if optimizer_cls_and_kwargs is not None:
        raise ConfigError("InfinityTrainer(optimizer_cls_and_kwargs=...): the engine runs its own AdamW; set its "
                          "hyper-parameters in TrainingArguments")


# Note [the user's model]: `trainer.model` keeps the dtype the user gave it (fp32 in, fp32 out), as the Trainer's
# does, and holds the trained weights after train() and at each save and evaluation. The engine shards and casts
# the module it is given (its parameters become views of compute-dtype buffers, NaN placeholders between steps:
# Note [parameters between steps]), so it is given a twin: the model's modules copied, its parameters not (the
# twin's view the same tensors until the engine replaces them with its own), so nothing is allocated twice at
# construction; `hold_trained_weights` then copies the engine's fp32 masters, one unit gathered at a time, into
# the user's trainable parameters (frozen ones never change). With bf16=True the engine computes in bf16 as
# TRL's autocast does, while the weights read back are the fp32 masters: a norm weight moved by 1e-4 reads as
# moved. A model built under `infinity.meta_init()` has no weights to keep: it is the engine's module, and
# `hold_trained_weights` says to read the engine (named_full_parameters / full_state_dict) or save_model.
def _materialized(model) -> bool:
    return not any(p.is_meta for p in model.parameters())


def _twin(model):
    """The model's modules copied with its parameters shared (new Parameter objects on the same tensors), for
    the engine to shard and cast (Note [the user's model])."""
    import copy
    memo = {id(p): nn.Parameter(p.data, requires_grad=p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)


class InfinityTrainerMixin:
    """The overrides shared by InfinityTrainer and InfinitySFTTrainer (Note [trainer on the engine])."""

    def __init__(self, *args, infinity_config=None, infinity_weights=None, **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is not None:
            engine_config_for(training_args, infinity_config)  # refused before the parent does any work
        self.engine = None
        super().__init__(*args, **kwargs)
        _refuse_own_optimizer((self.optimizer, self.lr_scheduler), getattr(self, "optimizer_cls_and_kwargs", None))
        self._given_config = infinity_config
        # (transformers 5: activation_checkpointing is the new name): the engine checkpoints units; HF's own would
        # do it twice, so the arguments say False once the engine's config has read them
        self._checkpointing = {name: getattr(self.args, name) for name in ("gradient_checkpointing",
                                                                             "activation_checkpointing")
                               if getattr(self.args, name, False)}
        self.infinity_config = self._engine_config()
        self._infinity_weights = infinity_weights
        self._build_engine(self.model)
        self._grad_norm = torch.zeros(())
        self.add_callback(_GradNormLog(self))
        self.callback_handler.callbacks.insert(0, _SayWhatRuns(self))  # before the progress bar starts: its
        # line is printed above the bar, not inside it

    def _engine_config(self):
        """The engine's config from the arguments as given (Note [training arguments win])."""
        for name, value in self._checkpointing.items():
            setattr(self.args, name, value)
        try:
            return engine_config_for(self.args, self._given_config)
        finally:
            for name in self._checkpointing:
                setattr(self.args, name, False)

    def _build_engine(self, model) -> None:
        """The engine over `model` (a twin of it: Note [the user's model]), with the Trainer's decay groups."""
        _name_the_base(model, self._infinity_weights)
        decay = set(self.get_decay_parameter_names(model))
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [n for n in trainable if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [n for n in trainable if n not in decay], "weight_decay": 0.0}]
        self._holds_weights = _materialized(model)  # Note [the user's model]
        self.engine = initialize(_twin(model) if self._holds_weights else model, self.infinity_config,
                                 weights=self._infinity_weights, param_groups=[g for g in groups if g["params"]])
        self._forward = EngineForward(self.engine, model)

    def call_model_init(self, trial=None):
        """`model_init=`: train() starts from a fresh model each time (the Trainer calls this at its start), so the
        engine is built again over it: fresh weights and optimizer state (the first call, from the constructor, is
        the model the constructor's engine is built over)."""
        model = super().call_model_init(trial)
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.infinity_config = self._engine_config()  # (a hyper-parameter search sets the arguments per trial)
            self._build_engine(model)
        return model

    # ----------------------------------------------------------------- the user's model (Note [the user's model])
    def hold_trained_weights(self) -> None:
        """Copy the engine's trained weights (its fp32 masters, gathered unit by unit) into `trainer.model`, at
        the model's own dtype: done after train(), before each save and evaluation. A model built under
        `infinity.meta_init()` is the engine's own module: refused, naming what reads its weights instead."""
        if not self._holds_weights:
            raise ConfigError("trainer.model was built under infinity.meta_init(): it is the engine's module and "
                              "holds no whole weights; read them with trainer.engine.named_full_parameters() or "
                              "trainer.engine.full_state_dict(), or write them with trainer.save_model(dir)")
        trainable = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        seen = set()
        with torch.no_grad():
            for name, value in self.engine.named_full_parameters(dtype=torch.float32):
                param = trainable.get(name)
                if param is not None:
                    param.copy_(value.to(device=param.device, dtype=param.dtype))
                    seen.add(name)
        missing = set(trainable) - seen
        if missing:  # (the twin has the model's names: a mismatch is a bug, never skipped)
            raise RuntimeError(f"the engine returned no weights for trainer.model's {sorted(missing)[:3]}")

    def _hold(self) -> None:
        if self._holds_weights and self.engine is not None:
            self.hold_trained_weights()

    def train(self, *args, **kwargs):
        try:
            return super().train(*args, **kwargs)
        finally:
            self._hold()

    def evaluate(self, *args, **kwargs):
        self._hold()
        return super().evaluate(*args, **kwargs)

    # ----------------------------------------------------------------- placement and wrapping
    def _move_model_to_device(self, model, device):
        """Nothing: the engine places the parameters (a meta model has nothing to move)."""

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        return self._forward

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = ModelOptimizer(self.engine.optimizer, self.model)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's scheduler, or a DeepSpeed config's (`InfinityTrainingArguments(deepspeed=...)` with a
        `scheduler`: it replaces lr_scheduler_type, as under DeepSpeed; Note [deepspeed through the Trainer])."""
        plan = getattr(self.args, "deepspeed_plan", None)
        if self.lr_scheduler is None and plan is not None and plan.scheduler is not None:
            from infinity.hf.deepspeed import deepspeed_schedule
            factor = deepspeed_schedule(plan, self.args, num_training_steps)
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            self._created_lr_scheduler = True
        return super().create_scheduler(num_training_steps, optimizer)

    # ----------------------------------------------------------------- the step
    def training_step(self, model, inputs, num_items_in_batch=None):
        """As Trainer.training_step (the same loss and the same scaling for accumulation), with the backward
        on the engine: `engine.backward` divides by grad_accum_steps itself, so it gets the loss times that.
        With the Trainer's `num_items_in_batch` the loss is already the window's share (its items over the
        window's on all ranks, times the world size when averaged across devices, as DDP's average expects:
        the engine averages over ranks as DDP does), so the window is one big batch's token mean (Note
        [token-weighted windows])."""
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        scaled = self.loss_is_scaled_for_ga
        if scaled is None:
            scaled = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        # the Trainer's last window of an epoch may be shorter: its sync step ends the engine's window too
        # (Note [accumulation windows]); the Trainer scaled that window's losses by its own length
        self.engine.backward(loss * self.args.gradient_accumulation_steps, end_window=self.accelerator.sync_gradients)
        return loss.detach()

    def _clip_grad_norm(self, model):
        """The engine clips inside step() (Note [trainer on the engine]); the norm is filled in after it."""
        return self._grad_norm

    def _get_grad_norm(self, model, grad_norm=None):
        return self._grad_norm

    # ----------------------------------------------------------------- saving and resuming
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A standalone Hugging Face directory (`from_pretrained` loads it): the engine's export, the model's
        config, the processing class and the training arguments. In a Trainer checkpoint the engine
        checkpoint it is exported from stays (`infinity/`, read back on resume)."""
        from infinity.state.export import export_checkpoint
        output_dir = output_dir or self.args.output_dir
        self._hold()  # trainer.model holds what is saved (Note [the user's model])
        checkpoint = os.path.join(output_dir, ENGINE_CHECKPOINT)
        replaced = f"{checkpoint}.replaced"
        if self.args.should_save and os.path.isdir(checkpoint):  # (a resumed run saving a step again, as the
            os.replace(checkpoint, replaced)                     # Trainer overwrites checkpoint-N: the old
        self.accelerator.wait_for_everyone()                     # one goes once the new one is complete)
        self.engine.save_checkpoint(checkpoint)
        self.engine.wait_for_checkpoint()
        if self.args.should_save and os.path.isdir(replaced):
            import shutil
            shutil.rmtree(replaced)
        if self.args.should_save:
            module = self.engine.module
            export_checkpoint(checkpoint, output_dir, fmt="hf", model=module)
            if not getattr(module, "peft_config", None):  # adapters: no base config (Note [adapter directory])
                if getattr(module, "config", None) is not None:
                    module.config.save_pretrained(output_dir)
                if getattr(module, "generation_config", None) is not None and hasattr(module, "can_generate") \
                        and module.can_generate():
                    module.generation_config.save_pretrained(output_dir)
            tokenizer = self.processing_class  # as Trainer._save: else the collator's tokenizer
            if tokenizer is None:
                tokenizer = getattr(self.data_collator, "tokenizer", None)
            if tokenizer is not None:
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
            if not _internal_call:
                import shutil
                shutil.rmtree(checkpoint)
        self.accelerator.wait_for_everyone()  # the directory is complete when every rank returns

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine checkpoint is written by save_model (just before); here the scheduler's state and, as the
        Trainer writes it, the optimizer's `state_dict()` (engine.optimizer's: its groups and learning rates; the
        Adam moments are in the engine checkpoint `infinity/`, which resuming reads)."""
        if self.args.should_save:
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_FILE))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Nothing: the weights come back with the engine checkpoint (_load_optimizer_and_scheduler)."""
        if not os.path.isdir(resume_from_checkpoint):  # (the Trainer's words for it)
            raise ConfigError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: no such directory")
        if not os.path.isdir(os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT)):
            raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r} has no {ENGINE_CHECKPOINT}/ "
                              f"engine checkpoint: resume from a checkpoint-N folder an Infinity trainer saved")

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: the best checkpoint-N's engine checkpoint. The Trainer's own load wrote the
        exported weights into the module's parameters: the engine's forward ran the best weights (where the
        parameters alias its stored ones) while its fp32 masters stayed the last step's, and save_model then
        exported the last step's weights as the best."""
        self._load_from_checkpoint(self.state.best_model_checkpoint)  # (refuses a folder without infinity/)
        self.engine.load_checkpoint(os.path.join(self.state.best_model_checkpoint, ENGINE_CHECKPOINT))

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if checkpoint is None:
            return
        self.engine.load_checkpoint(os.path.join(checkpoint, ENGINE_CHECKPOINT))
        path = os.path.join(checkpoint, SCHEDULER_FILE)
        if os.path.isfile(path):
            self.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))


class InfinityTrainer(InfinityTrainerMixin, Trainer):
    """`transformers.Trainer` on the infinity engine: the parent's constructor plus `infinity_config=` (a
    Config, a dict, a TOML path) and `infinity_weights=` (weights for a model built under meta_init)."""
