"""InfinityAccelerator: the engine in a custom accelerate loop, against the same loop with a plain torch model and
torch's AdamW under accelerate's own Accelerator."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, get_scheduler  # noqa: E402

import infinity  # noqa: E402
from infinity.config.sections import ConfigError  # noqa: E402
from infinity.hf.accelerate import InfinityAccelerator  # noqa: E402

VOCAB, ACCUM, MICRO_STEPS = 64, 2, 12
HYPER = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.05)


@pytest.fixture(autouse=True)
def fresh_state():
    """accelerate keeps one process-wide state (its gradient accumulation plugin among it): reset per test."""
    from accelerate.state import AcceleratorState, GradientState
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def tiny_llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def loader(micro_steps=MICRO_STEPS):
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, VOCAB, (2 * micro_steps, 12), generator=g)
    return torch.utils.data.DataLoader([{"input_ids": r, "labels": r} for r in rows], batch_size=2)


def engine_config(**over):
    cfg = {"placement": {"params": "host", "grads": "host", "optimizer": "host"},
           "precision": {"compute_dtype": "fp32"}, "overlap": {"optimizer_with_backward": False},
           "optimizer": {**HYPER, "betas": list(HYPER["betas"]), "grad_clip": 1.0},
           "train": {"grad_accum_steps": ACCUM}}
    cfg.update(over)
    return cfg


def loop(accelerator, model, optimizer, scheduler, clip_params, micro_steps=MICRO_STEPS):
    """The user's loop, the same for both: accumulate, backward, clip, step, schedule, zero_grad."""
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, loader(micro_steps), scheduler)
    losses, lrs = [], []
    for batch in data:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            losses.append(loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(clip_params, 1.0)
                lrs.append(scheduler.get_last_lr()[0])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses, lrs


@pytest.mark.parametrize("micro_steps", [MICRO_STEPS, 7])
def test_the_engine_in_an_accelerate_loop_equals_torch(micro_steps):
    """Losses (every micro-batch) and learning rates equal the torch loop's: accumulation 2 through
    accelerator.accumulate, clipping at 1.0, a cosine schedule with warmup stepped through accelerate; with 7
    micro-batches the last window is shorter (accelerate ends it at the end of the data)."""
    steps = -(-micro_steps // ACCUM)
    model = tiny_llama()
    torch_opt = torch.optim.AdamW(model.parameters(), **HYPER)
    ref = loop(Accelerator(gradient_accumulation_steps=ACCUM, cpu=True), model, torch_opt,
               get_scheduler("cosine", torch_opt, num_warmup_steps=2, num_training_steps=steps),
               list(model.parameters()), micro_steps)
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    user_model = tiny_llama()
    engine = infinity.initialize(user_model, engine_config())
    ours = loop(InfinityAccelerator(gradient_accumulation_steps=ACCUM, cpu=True), engine, engine.optimizer,
                get_scheduler("cosine", engine.optimizer, num_warmup_steps=2, num_training_steps=steps),
                list(user_model.parameters()), micro_steps)
    assert engine.optimizer_steps == steps and len(ours[1]) == steps
    assert ours[1] == pytest.approx(ref[1], rel=1e-12)
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref[0]), rtol=1e-5, atol=0)
    engine.close()


def test_what_cannot_work_is_refused():
    with pytest.raises(ConfigError, match=r"mixed_precision='bf16'.*compute_dtype"):
        InfinityAccelerator(mixed_precision="bf16", cpu=True)
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = tiny_llama()
    engine = infinity.initialize(model, engine_config())
    accelerator = InfinityAccelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    with pytest.raises(ConfigError, match=r"prepare the engine first"):
        accelerator.backward(torch.zeros(()))
    with pytest.raises(ConfigError, match=r"pass the engine returned by infinity.initialize"):
        accelerator.prepare(engine, engine.module)
    prepared = accelerator.prepare(engine)
    assert prepared is engine
    with pytest.raises(ConfigError, match=r"clips the global L2 norm .*optimizer.grad_clip = 1.0"):
        accelerator.clip_grad_norm_(model.parameters(), 0.5)
    with pytest.raises(ConfigError, match=r"engine.save_checkpoint"):
        accelerator.save_state("unused")
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=3\) but the engine's train.grad_accum_steps"):
        InfinityAccelerator(gradient_accumulation_steps=3, cpu=True).prepare(engine)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=1\) but the engine's train.grad_accum_steps"):
        InfinityAccelerator(cpu=True).prepare(engine)
    engine.close()


@pytest.mark.slow
def test_two_ranks_under_torchrun_equal_ddp(tmp_path):
    """tests/hf/accelerate_loop.py under `torchrun --nproc-per-node 2` (gloo): accelerate shards the data, the
    engine reduces the gradients over the process group accelerate set up; every rank's losses equal the same loop
    with a torch model under accelerate's DDP."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    out = {}
    for kind in ("torch", "infinity"):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                               str(root / "tests" / "hf" / "accelerate_loop.py"), kind, str(tmp_path / kind)],
                              env=env, capture_output=True, text=True, timeout=240)  # (stacks dumped at 150 s)
        assert proc.returncode == 0, proc.stderr[-6000:]
        out[kind] = json.loads((tmp_path / kind).read_text())
    assert len(out["torch"]) == 8 and all(len(row) == 2 for row in out["torch"])
    torch.testing.assert_close(torch.tensor(out["infinity"]), torch.tensor(out["torch"]), rtol=1e-5, atol=0)
