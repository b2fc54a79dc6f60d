"""What transformers' own Trainer tests found InfinityTrainer lacking (docs/hf-trainer.md, the run by hand), each
checked here against transformers' Trainer on the same script: scalar (0-dim) parameters trained and saved,
`model_init` restarting from scratch, the checkpoint's files, `trainer.optimizer`'s groups holding the model's
parameters, and the refusals."""

import os

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402

from infinity.config.sections import ConfigError  # noqa: E402
from infinity.hf import InfinityTrainer  # noqa: E402


class Line(nn.Module):
    """y = a x + b with two scalar parameters, a mean squared error against `labels`."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(0.5)), nn.Parameter(torch.tensor(-0.25))

    def forward(self, x, labels=None):
        y = self.a * x + self.b
        return {"loss": nn.functional.mse_loss(y, labels), "y": y} if labels is not None else {"y": y}


class Points(torch.utils.data.Dataset):
    def __init__(self, n=32):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(n, generator=g)
        self.y = 2 * self.x + 1 + 0.05 * torch.randn(n, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, learning_rate=0.1, num_train_epochs=2,
                logging_steps=1, save_strategy="no", report_to=[], seed=5, use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


def weights(model):
    return torch.stack([model.a.detach(), model.b.detach()])


def test_scalar_parameters_train_and_save_as_with_the_trainer(tmp_path):
    """0-dim parameters: the same trained values as the Trainer's, saved in a checkpoint (model.safetensors beside
    optimizer.pt and scheduler.pt, as the Trainer writes them) and by save_model."""
    ref = Trainer(model=Line(), args=args(tmp_path / "ref"), train_dataset=Points())
    ref.train()
    ours = InfinityTrainer(model=Line(), args=args(tmp_path / "ours", save_strategy="steps", save_steps=8),
                           train_dataset=Points())
    ours.train()
    torch.testing.assert_close(weights(ours.model), weights(ref.model), rtol=1e-5, atol=1e-6)
    checkpoint = tmp_path / "ours" / "checkpoint-8"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin"):
        assert (checkpoint / name).is_file(), name
    ours.save_model(str(tmp_path / "saved"))
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved["a"].shape == () and saved["b"].shape == ()
    torch.testing.assert_close(torch.stack([saved["a"], saved["b"]]), weights(ours.model), rtol=0, atol=0)
    ours.engine.close()


def test_model_init_restarts_from_scratch_each_train(tmp_path):
    """With model_init=, each train() starts from a fresh model (and fresh optimizer state), as the Trainer's; the
    engine built again keeps what the arguments said (gradient_checkpointing, which the Trainer must not see)."""
    ref = Trainer(model_init=Line, args=args(tmp_path / "ref"), train_dataset=Points())
    ref.train()
    ours = InfinityTrainer(model_init=Line, args=args(tmp_path / "ours", gradient_checkpointing=True),
                           train_dataset=Points())
    ours.train()
    first = weights(ours.model).clone()
    ours.train()
    torch.testing.assert_close(weights(ours.model), first, rtol=0, atol=0)
    assert ours.engine.config.activation.checkpoint == "units"  # (the rebuilt engine reads the arguments as given)
    torch.testing.assert_close(first, weights(ref.model), rtol=1e-5, atol=1e-6)
    ours.engine.close()


def test_the_optimizers_groups_hold_the_models_parameters(tmp_path):
    """trainer.optimizer.param_groups[i]["params"] are trainer.model's parameters, split as the Trainer splits them
    (decay / no decay); a scheduler's lr write reaches the engine."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 1))
    ref = Trainer(model=model, args=args(tmp_path / "ref"))
    ref.create_optimizer()
    ours = InfinityTrainer(model=model, args=args(tmp_path / "ours"))
    ours.create_optimizer()
    assert [len(g["params"]) for g in ours.optimizer.param_groups] == [len(g["params"])
                                                                        for g in ref.optimizer.param_groups]
    for g_ours, g_ref in zip(ours.optimizer.param_groups, ref.optimizer.param_groups):
        assert all(p is q for p, q in zip(g_ours["params"], g_ref["params"]))
        assert g_ours["weight_decay"] == g_ref["weight_decay"]
    first = next(model.parameters())
    assert ours.get_optimizer_group(first)["params"][0] is first
    ours.optimizer.param_groups[1]["lr"] = 0.25
    assert ours.engine.optimizer.param_groups[1]["lr"] == 0.25
    ours.engine.close()


def test_what_the_engine_cannot_honour_is_refused(tmp_path):
    model = Line()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"optimizers=\.\.\.\): the engine runs its own AdamW"):
        InfinityTrainer(model=model, args=args(tmp_path), train_dataset=Points(), optimizers=(sgd, None))
    trainer = InfinityTrainer(model=Line(), args=args(tmp_path), train_dataset=Points())
    with pytest.raises(ConfigError, match=r"Can't find a valid checkpoint at .*nowhere: no such directory"):
        trainer.train(resume_from_checkpoint=os.path.join(str(tmp_path), "nowhere"))
    trainer.engine.close()
