"""The engine inside a custom `accelerate` loop: `InfinityAccelerator` for `accelerate.Accelerator` (docs/hf-trainer.md,
"A custom accelerate loop").

    accelerator = InfinityAccelerator(gradient_accumulation_steps=2)       # was: Accelerator(...)
    engine = infinity.initialize(model, config)                            # config: train.grad_accum_steps = 2
    scheduler = get_scheduler("cosine", engine.optimizer, 10, 100)         # any torch scheduler on engine.optimizer
    engine, optimizer, loader, scheduler = accelerator.prepare(engine, engine.optimizer, loader, scheduler)
    for batch in loader:
        with accelerator.accumulate(engine):
            loss = engine(**batch).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)            # = config's optimizer.grad_clip
            optimizer.step(); scheduler.step(); optimizer.zero_grad()

Note [accelerate loop]: accelerate keeps what it does for any loop (the data loader's sharding and device
placement, `accumulate`'s windows, `sync_gradients`, the scheduler stepping with the optimizer, `gather`, `print`,
`is_main_process`); the engine keeps the model's state. `prepare` passes the engine through untouched (it is not a
Module: no device move, no DDP wrapper: the engine reduces gradients over the process group accelerate set up) and
wraps `engine.optimizer` as any optimizer, without moving its (empty) state; `backward` is `engine.backward` (it
scales by 1 / grad_accum_steps itself, as accelerate would, and ends the window at accelerate's sync step, so an
epoch's shorter last window ends where accelerate's does; the two accumulations must be equal); clipping
is the engine's (`[optimizer] grad_clip`, inside `optimizer.step()`), so `clip_grad_norm_` accepts only that
max_norm and returns the last step's norm (None before the first), as accelerate does under DeepSpeed. Refused,
with the fix: accelerate's own mixed precision (the engine computes in `[precision] compute_dtype`), its DeepSpeed,
FSDP, Megatron and XLA back-ends, passing the engine's model instead of the engine, an accumulation that differs
from the engine's, `backward` keyword arguments, and `save_state` / `load_state` (the engine's state is sharded
over tiers: `engine.save_checkpoint(dir)` / `engine.load_checkpoint(dir)`, the scheduler's `state_dict()` beside).
"""

from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch import nn

from infinity.config.sections import ConfigError
from infinity.runtime.engine import Engine

__all__ = ["InfinityAccelerator"]

REFUSED_BACKENDS = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
                    DistributedType.MEGATRON_LM: "Megatron-LM", DistributedType.XLA: "XLA"}


class InfinityAccelerator(Accelerator):
    """`accelerate.Accelerator` whose `prepare` takes an infinity Engine (Note [accelerate loop])."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.distributed_type in REFUSED_BACKENDS:
            raise ConfigError(f"InfinityAccelerator: accelerate is configured for "
                              f"{REFUSED_BACKENDS[self.distributed_type]}, which would shard the model a second time; "
                              f"infinity shards it itself: use a plain multi-GPU / multi-process accelerate config")
        if self.mixed_precision != "no":
            raise ConfigError(f"InfinityAccelerator(mixed_precision={self.mixed_precision!r}): the engine computes in "
                              f"[precision] compute_dtype (master weights fp32); set that in the engine's config and "
                              f"leave accelerate's mixed precision \"no\"")
        self.engine: Engine | None = None

    def prepare(self, *args, device_placement=None):
        engines = [a for a in args if isinstance(a, Engine)]
        if len(engines) > 1 or (engines and self.engine is not None and engines[0] is not self.engine):
            raise ConfigError("InfinityAccelerator.prepare: one engine per accelerator")
        engine = engines[0] if engines else self.engine
        if engine is not None:
            for a in args:
                if isinstance(a, nn.Module) and a is engine.module:
                    raise ConfigError("InfinityAccelerator.prepare(model): the engine trains this model; pass the "
                                      "engine returned by infinity.initialize instead, and call engine(batch)")
            steps = engine.config.train.grad_accum_steps
            if self.gradient_accumulation_steps != steps:  # (else accelerate steps the scheduler per micro-batch)
                raise ConfigError(f"InfinityAccelerator(gradient_accumulation_steps={self.gradient_accumulation_steps})"
                                  f" but the engine's train.grad_accum_steps = {steps}: set both to the same number")
            self.engine = engine
        placement = list(device_placement) if device_placement is not None else [None] * len(args)
        for i, a in enumerate(args):
            if engine is not None and a is engine.optimizer:
                placement[i] = False  # (its groups are the engine's lrs: never rebuilt from a state dict)
        return super().prepare(*args, device_placement=placement)

    def _engine(self, what: str) -> Engine:
        if self.engine is None:
            raise ConfigError(f"InfinityAccelerator.{what}: prepare the engine first: "
                              f"accelerator.prepare(engine, engine.optimizer, ...)")
        return self.engine

    def backward(self, loss, **kwargs):
        """`engine.backward(loss)`: the engine scales by its accumulation window (Note [accelerate loop])."""
        engine = self._engine("backward")
        if kwargs:
            raise ConfigError(f"InfinityAccelerator.backward({', '.join(kwargs)}=...): the engine's backward takes "
                              f"only the loss")
        engine.backward(loss, end_window=self.sync_gradients)  # (an epoch's shorter last window ends early)

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """The engine clips inside `optimizer.step()` at `[optimizer] grad_clip`: this accepts that max_norm and
        returns the last step's global norm (None before the first), as accelerate under DeepSpeed."""
        engine = self._engine("clip_grad_norm_")
        clip = engine.config.optimizer.grad_clip
        if float(norm_type) != 2.0 or float(max_norm) != clip:
            raise ConfigError(f"accelerator.clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}): the engine "
                              f"clips the global L2 norm inside optimizer.step() at optimizer.grad_clip = {clip}; set "
                              f"grad_clip = {max_norm} in the engine's config (or pass max_norm={clip})")
        return engine.last_grad_norm

    def clip_grad_value_(self, parameters, clip_value):
        raise ConfigError("accelerator.clip_grad_value_: the engine clips by the global norm only "
                          "([optimizer] grad_clip, with accelerator.clip_grad_norm_)")

    def save_state(self, output_dir=None, *args, **kwargs):
        if self.engine is not None:
            raise ConfigError("accelerator.save_state: the engine's state is sharded over its tiers; save it with "
                              "engine.save_checkpoint(dir) (and torch.save(scheduler.state_dict(), ...) beside it)")
        return super().save_state(output_dir, *args, **kwargs)

    def load_state(self, input_dir=None, *args, **kwargs):
        if self.engine is not None:
            raise ConfigError("accelerator.load_state: load the engine's state with engine.load_checkpoint(dir) "
                              "(and scheduler.load_state_dict(...))")
        return super().load_state(input_dir, *args, **kwargs)
