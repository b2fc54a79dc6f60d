"""InfinityTrainer / InfinitySFTTrainer against transformers' Trainer / TRL's SFTTrainer on the same script."""


import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

import infinity  # noqa: E402
from infinity.hf import InfinityTrainer  # noqa: E402
from infinity.hf.trainer import run_line  # noqa: E402

VOCAB = 64


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_bias=True)  # (biases: the no-decay group has more than norms)
    return LlamaForCausalLM(cfg)


def lm_dataset(n, length=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])


def args_for(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, per_device_eval_batch_size=4,
                learning_rate=3e-3, weight_decay=0.1, adam_beta1=0.85, adam_beta2=0.97, adam_epsilon=1e-7,
                max_grad_norm=0.5, gradient_accumulation_steps=2, lr_scheduler_type="cosine", warmup_steps=3,
                max_steps=32, logging_steps=1, eval_strategy="steps", eval_steps=16, save_strategy="no",
                report_to=[], seed=7, use_cpu=True, disable_tqdm=True, dataloader_drop_last=True)
    base.update(kw)
    return TrainingArguments(**base)


def losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def eval_losses(trainer):
    return [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


def run(cls, out, train, evals, **kw):
    trainer = cls(model=tiny_llama(), args=args_for(out, **kw), train_dataset=train, eval_dataset=evals)
    trainer.train()
    return trainer


def test_losses_and_eval_equal_the_trainer(tmp_path, use_cpu=True):
    """On the CPU at fp32 tolerances. `use_cpu=False` (the GPU twin): both trainers on the GPU, where their AdamW
    kernels differ (the engine's, torch's) in the last bits over 32 steps: losses and eval losses within 1e-4
    relative, grad norms, predictions and the saved model's logits within 1e-3."""
    exact = use_cpu
    train, evals = lm_dataset(32), lm_dataset(8, seed=2)
    ref = run(Trainer, tmp_path / "ref", train, evals, use_cpu=use_cpu)
    ours = run(InfinityTrainer, tmp_path / "ours", train, evals, use_cpu=use_cpu)
    assert len(losses(ref)) == 32
    loss_rtol = 1e-5 if exact else 1e-4
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=loss_rtol, atol=0)
    torch.testing.assert_close(torch.tensor(eval_losses(ours)), torch.tensor(eval_losses(ref)), rtol=loss_rtol,
                               atol=0)
    ref_lr = [h["learning_rate"] for h in ref.state.log_history if "loss" in h]
    our_lr = [h["learning_rate"] for h in ours.state.log_history if "loss" in h]
    assert our_lr == pytest.approx(ref_lr, rel=1e-12)
    ref_gn = [h["grad_norm"] for h in ref.state.log_history if "loss" in h]
    our_gn = [h["grad_norm"] for h in ours.state.log_history if "loss" in h]
    assert our_gn == pytest.approx(ref_gn, rel=1e-4 if exact else 1e-3)
    # the groups the engine runs are the Trainer's: no decay on biases and norm weights
    no_decay = {n for g in ours.engine.param_groups if g["weight_decay"] == 0.0 for n in g["params"]}
    assert no_decay == {n for n, _ in ref.model.named_parameters()} - set(ref.get_decay_parameter_names(ref.model))
    assert any(n.endswith("bias") for n in no_decay) and any("norm" in n for n in no_decay)
    # predict: the engine's forward under no_grad, the reference's logits
    p_ref, p_ours = ref.predict(evals), ours.predict(evals)
    rtol, atol = (1e-4, 1e-5) if exact else (1e-3, 1e-4)
    torch.testing.assert_close(torch.tensor(p_ours.predictions), torch.tensor(p_ref.predictions), rtol=rtol, atol=atol)
    # save_model: a standalone HF directory with the trained weights
    ours.save_model(str(tmp_path / "saved"))
    ref.save_model(str(tmp_path / "saved_ref"))
    mine = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    theirs = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved_ref"))
    x = torch.tensor(lm_dataset(2, seed=3)["input_ids"])
    torch.testing.assert_close(mine(x).logits, theirs(x).logits, rtol=rtol, atol=atol)
    ours.engine.close()


def test_resume_from_checkpoint_is_bitwise(tmp_path):
    """16 steps straight vs 8 steps, a checkpoint-8 folder, and a new trainer resuming from it."""
    train = lm_dataset(32)
    kw = dict(max_steps=16, eval_strategy="no", gradient_accumulation_steps=1, save_strategy="steps", save_steps=8)
    straight = run(InfinityTrainer, tmp_path / "a", train, None, **kw)
    first = InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path / "b", **kw), train_dataset=train)
    first.train()  # (writes checkpoint-8 and checkpoint-16; we resume from 8)
    first.engine.close()
    ckpt = tmp_path / "b" / "checkpoint-8"
    assert (ckpt / "infinity").is_dir() and (ckpt / "config.json").is_file()
    resumed = InfinityTrainer(model=tiny_llama(seed=5), args=args_for(tmp_path / "b", **kw), train_dataset=train)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert losses(resumed)[-8:] == losses(straight)[-8:]  # bitwise
    a, b = straight.engine.full_state_dict(), resumed.engine.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    straight.engine.close()
    resumed.engine.close()


def test_load_best_model_at_end_loads_the_best_checkpoint_into_the_engine(tmp_path):
    """The Trainer's own load wrote the best weights into the module's parameters only: the engine's masters
    (what save_model exports) stayed the last step's. At this learning rate the eval loss rises after the first
    evaluation, so the best checkpoint is not the last."""
    kw = dict(max_steps=6, gradient_accumulation_steps=1, eval_steps=2, save_strategy="steps", save_steps=2,
              load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=False,
              learning_rate=0.3)  # too high: the eval loss rises after the first evaluation
    trainer = run(InfinityTrainer, tmp_path, lm_dataset(12), lm_dataset(4, seed=2), **kw)
    best = trainer.state.best_model_checkpoint
    assert not best.endswith("checkpoint-6"), best
    loaded, want = trainer.engine.full_state_dict(), LlamaForCausalLM.from_pretrained(best).state_dict()
    assert all(torch.equal(loaded[k], want[k]) for k in loaded)
    trainer.engine.close()


def test_gradient_checkpointing_is_the_engines_units(tmp_path):
    train = lm_dataset(16)
    kw = dict(max_steps=6, eval_strategy="no", gradient_accumulation_steps=1)
    ref = run(Trainer, tmp_path / "r", train, None, **kw)
    ours = run(InfinityTrainer, tmp_path / "o", train, None, gradient_checkpointing=True, **kw)
    assert ours.infinity_config.activation.checkpoint == "units" and not ours.args.gradient_checkpointing
    assert not ours.model.is_activation_checkpointing  # (transformers 5's own, under its new name: not twice)
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    ours.engine.close()


@pytest.mark.parametrize("kw, names", [
    (dict(optim="adafactor"), "optim"), (dict(fp16=True), "fp16"), (dict(torch_compile=True), "torch_compile"),
    (dict(optim_args="foo=1"), "optim_args"),
    (dict(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False, "debug": True}),
     "only use_reentrant is accepted"),
])
def test_what_the_engine_cannot_honour_is_refused(tmp_path, kw, names):
    with pytest.raises(infinity.ConfigError, match=names):
        InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path, **kw), train_dataset=lm_dataset(4))


def test_use_cpu_on_a_machine_with_a_gpu_is_refused(tmp_path, monkeypatch):
    """The engine trains on the GPU whenever there is one: use_cpu=True would leave the Trainer's loss and inputs
    on the CPU (transformers: "Calculated loss must be on the original device"). On the CPU it is accepted (every
    other test here sets it)."""
    args = args_for(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(infinity.ConfigError, match=r"use_cpu=True: this machine has a GPU .* CUDA_VISIBLE_DEVICES="):
        InfinityTrainer(model=tiny_llama(), args=args, train_dataset=lm_dataset(4))


def test_the_wrapped_model_generates_as_the_model_does(tmp_path):
    """Trainers that sample from the model they wrapped (TRL's GRPO, predict_with_generate) call `generate` on it:
    the engine's forward generates the same greedy tokens as transformers' model with the same weights."""
    reference = tiny_llama(seed=3)
    trainer = InfinityTrainer(model=tiny_llama(seed=3), args=args_for(tmp_path, eval_strategy="no"),
                              train_dataset=lm_dataset(4))
    try:
        prompt = torch.tensor([lm_dataset(1, length=5, seed=4)["input_ids"][0]])
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        wrapped = trainer._wrap_model(trainer.model)
        torch.testing.assert_close(wrapped.generate(prompt, **kw), reference.generate(prompt, **kw), rtol=0, atol=0)
    finally:
        trainer.engine.close()


def test_infinity_config_cannot_contradict_the_arguments(tmp_path):
    with pytest.raises(infinity.ConfigError, match="optimizer.lr"):
        InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path), train_dataset=lm_dataset(4),
                        infinity_config={"optimizer": {"lr": 1.0}})


def test_a_missing_infinity_config_file_is_named(tmp_path):
    """infinity_config="nope.toml" (no such file): a ConfigError naming the argument, the path and the fix, as the
    CLI's --config (not a bare FileNotFoundError)."""
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(infinity.ConfigError, match=rf"infinity_config='{missing}': config file {missing}: cannot "
                                                   r"read it \(No such file or directory\); give the path of a TOML"):
        InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path), train_dataset=lm_dataset(4),
                        infinity_config=missing)


def test_an_epochs_shorter_last_window_is_the_trainers(tmp_path):
    """7 batches per epoch with gradient_accumulation_steps = 3: windows of 3, 3 and 1, two epochs; the Trainer
    scales the short window by its own length and steps it (Note [accumulation windows])."""
    train = lm_dataset(14)
    kw = dict(gradient_accumulation_steps=3, max_steps=-1, num_train_epochs=2, eval_strategy="no")
    ref = run(Trainer, tmp_path / "ref", train, None, **kw)
    ours = run(InfinityTrainer, tmp_path / "ours", train, None, **kw)
    assert len(losses(ref)) == 6 and ours.engine.optimizer_steps == 6
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    ref_gn = [h["grad_norm"] for h in ref.state.log_history if "loss" in h]
    our_gn = [h["grad_norm"] for h in ours.state.log_history if "loss" in h]
    assert our_gn == pytest.approx(ref_gn, rel=1e-4)
    ours.engine.close()


def test_meta_model_with_weights_trains_as_the_loaded_model(tmp_path):
    """A model built under meta_init plus infinity_weights= (a pretrained directory) gives the losses of
    Trainer on the same pretrained model loaded whole."""
    tiny_llama(seed=11).save_pretrained(tmp_path / "pretrained")
    train = lm_dataset(16)
    kw = dict(max_steps=8, eval_strategy="no", gradient_accumulation_steps=1)
    ref = Trainer(model=LlamaForCausalLM.from_pretrained(tmp_path / "pretrained"), args=args_for(tmp_path / "r", **kw),
                  train_dataset=train)
    ref.train()
    with infinity.meta_init():
        model = LlamaForCausalLM(tiny_llama().config)
    ours = InfinityTrainer(model=model, args=args_for(tmp_path / "o", **kw), train_dataset=train,
                           infinity_weights=str(tmp_path / "pretrained"),
                           infinity_config={"placement": {"params": "host", "optimizer": "host"}})
    ours.train()
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    assert ours.model is model  # (no weights to keep: the engine's module; reading it says where the weights are)
    with pytest.raises(infinity.ConfigError, match="meta_init.*named_full_parameters"):
        ours.hold_trained_weights()
    ours.engine.close()


def chat_data(n=16):
    """A word-level tokenizer with a chat template, and n chat records of its words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["hello", "world", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus", "four"]
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", "user", "assistant", ":"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                               "{% if add_generation_prompt %}assistant : {% endif %}")
    g = torch.Generator().manual_seed(0)

    def say(n):
        return " ".join(words[i] for i in torch.randint(0, 12, (n,), generator=g))
    rows = [{"messages": [{"role": "user", "content": say(4)}, {"role": "assistant", "content": say(5)}]}
            for _ in range(n)]
    return tokenizer, datasets.Dataset.from_list(rows)


def sft_beside_trl(tmp_path, tokenizer, ds, **args):
    """TRL's SFTTrainer and InfinitySFTTrainer trained on the same records and SFTConfig (`args` over the shared
    settings): (theirs, ours)."""
    trl = pytest.importorskip("trl")
    from infinity.hf import InfinitySFTTrainer

    def sft(cls, out):
        cfg = trl.SFTConfig(**{**dict(output_dir=str(out), per_device_train_batch_size=2, learning_rate=3e-3,
                                      logging_steps=1, save_strategy="no", report_to=[], seed=3, use_cpu=True,
                                      disable_tqdm=True, max_length=32, bf16=False), **args})
        trainer = cls(model=tiny_llama(), args=cfg, train_dataset=ds, processing_class=tokenizer)
        trainer.train()
        return trainer
    return sft(trl.SFTTrainer, tmp_path / "r"), sft(InfinitySFTTrainer, tmp_path / "o")


def test_sft_trainer_losses_equal(tmp_path):
    tokenizer, ds = chat_data()
    ref, ours = sft_beside_trl(tmp_path, tokenizer, ds, weight_decay=0.1, max_grad_norm=0.5,
                               gradient_accumulation_steps=2, lr_scheduler_type="cosine", max_steps=8,
                               dataloader_drop_last=True)
    assert len(losses(ref)) == 8
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    ours.engine.close()


def test_sft_peft_outputs_are_what_trl_writes(tmp_path):
    """Note [adapter directory]: with a peft_config, save_model(dir) and checkpoint-N hold what TRL's own
    SFTTrainer writes (the adapters, their config naming the base model, the tokenizer; no base config.json),
    with TRL's trained adapters, and both AutoModelForCausalLM and PeftModel load them."""
    import json

    peft = pytest.importorskip("peft")
    trl = pytest.importorskip("trl")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from infinity.hf import InfinitySFTTrainer
    tokenizer, ds = chat_data(8)
    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    tokenizer.save_pretrained(base)

    def sft(cls, out):
        cfg = trl.SFTConfig(output_dir=str(out), per_device_train_batch_size=2, learning_rate=1e-2, max_steps=2,
                            save_strategy="steps", save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
                            max_length=32, bf16=False, logging_steps=1)
        trainer = cls(model=LlamaForCausalLM.from_pretrained(base), args=cfg, train_dataset=ds,
                      processing_class=tokenizer,
                      peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        trainer.train()
        trainer.save_model(str(out / "final"))
        return trainer

    sft(trl.SFTTrainer, tmp_path / "r")
    sft(InfinitySFTTrainer, tmp_path / "o").engine.close()
    x = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    for sub in ("final", "checkpoint-2"):
        theirs, mine = tmp_path / "r" / sub, tmp_path / "o" / sub
        model_files = {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors"}
        assert {p.name for p in mine.iterdir()} & model_files == {p.name for p in theirs.iterdir()} & model_files
        config = json.loads((mine / "adapter_config.json").read_text())
        assert config == {**json.loads((theirs / "adapter_config.json").read_text()),
                          "target_modules": config["target_modules"]}
        trl_weights = load_file(theirs / "adapter_model.safetensors")
        our_weights = load_file(mine / "adapter_model.safetensors")
        assert set(our_weights) == set(trl_weights)
        for key in trl_weights:
            torch.testing.assert_close(our_weights[key], trl_weights[key], rtol=1e-4, atol=1e-6)
        with torch.no_grad():
            auto = AutoModelForCausalLM.from_pretrained(mine)(input_ids=x).logits
            wrapped = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), mine)(input_ids=x).logits
            reference = AutoModelForCausalLM.from_pretrained(theirs)(input_ids=x).logits
        torch.testing.assert_close(auto, reference, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(wrapped, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torchrun_two_ranks_gloo_equals_one_process_on_the_global_batch(tmp_path):
    """examples/hf_trainer.py under `torchrun --nproc-per-node 2` (gloo, 2 x 2 samples per micro-batch) gives
    the losses of plain Trainer in one process on 4 samples per micro-batch."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(root / "examples" / "hf_trainer.py"), "--out", str(tmp_path / "dist"),
                           "--steps", "6"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = json.loads((tmp_path / "dist" / "losses.json").read_text())

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dist" / "pretrained-0")
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 64, (16,), generator=g).tolist() for _ in range(64)]
    train = datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in rows])
    ref = Trainer(model=model, args=args_for(tmp_path / "ref", per_device_train_batch_size=4, learning_rate=1e-3,
                                             weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                                             max_grad_norm=1.0, warmup_steps=2, max_steps=6, eval_strategy="no"),
                  train_dataset=train)
    ref.train()
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses(ref)), rtol=1e-5, atol=0)


def ragged_dataset(n, seed=4):
    """Rows of 4..16 tokens whose labels mask a prefix of random length: unequal label counts per micro-batch."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length, masked = int(torch.randint(4, 17, (1,), generator=g)), int(torch.randint(0, 4, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * masked + ids[masked:]})
    return datasets.Dataset.from_list(rows)


def pad_collate(rows):
    """Right padding: id 0, attention 0, label -100."""
    width = max(len(r["input_ids"]) for r in rows)
    pad = [width - len(r["input_ids"]) for r in rows]
    return {"input_ids": torch.tensor([r["input_ids"] + [0] * p for r, p in zip(rows, pad)]),
            "attention_mask": torch.tensor([[1] * len(r["input_ids"]) + [0] * p for r, p in zip(rows, pad)]),
            "labels": torch.tensor([r["labels"] + [-100] * p for r, p in zip(rows, pad)])}


@pytest.mark.parametrize("chunk", [0, 5], ids=["logits", "chunked-loss"])
def test_a_window_of_unequal_lengths_is_weighted_by_its_tokens_as_the_trainers(tmp_path, chunk):
    """Note [token-weighted windows]: padded rows of unequal lengths with masked prefixes, accumulation 3: the
    Trainer's num_items_in_batch makes each window one big batch's token mean; InfinityTrainer's losses, grad
    norms and trained parameters are the Trainer's (also through the chunked loss, which takes the count)."""
    train = ragged_dataset(18)
    kw = dict(gradient_accumulation_steps=3, max_steps=3, eval_strategy="no", warmup_steps=0, max_grad_norm=1e9)

    def trained(cls, out, **extra):
        trainer = cls(model=tiny_llama(), args=args_for(out, **kw), train_dataset=train, data_collator=pad_collate,
                      **extra)
        trainer.train()
        return trainer
    ref = trained(Trainer, tmp_path / "ref")
    ours = trained(InfinityTrainer, tmp_path / "ours", infinity_config={"activation": {"loss_chunk_tokens": chunk}})
    assert len(losses(ref)) == 3
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    ref_gn = [h["grad_norm"] for h in ref.state.log_history if "loss" in h]
    assert [h["grad_norm"] for h in ours.state.log_history if "loss" in h] == pytest.approx(ref_gn, rel=1e-5)
    got = ours.engine.full_state_dict()
    for name, value in ref.model.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    ours.engine.close()


def test_sft_trainer_weights_a_window_of_unequal_completions_as_trl(tmp_path):
    """Prompt / completion records of unequal lengths (TRL masks the prompts), accumulation 3: TRL's SFTTrainer's
    losses (Note [token-weighted windows])."""
    tokenizer, _ = chat_data(1)
    words = ["hello", "world", "how", "are", "you", "fine", "thanks", "what", "is", "two", "plus", "four"]
    ds = datasets.Dataset.from_list([{"prompt": " ".join(words[i % 12:i % 12 + 1 + i % 5]),
                                      "completion": " " + " ".join(words[(i * 7) % 12:(i * 7) % 12 + 1 + (i * 3) % 4])}
                                     for i in range(18)])
    ref, ours = sft_beside_trl(tmp_path, tokenizer, ds, gradient_accumulation_steps=3, max_steps=3)
    assert len(losses(ref)) == 3
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    ours.engine.close()


def test_the_trainers_say_what_they_run_once_at_start(tmp_path, capsys):
    """One line at train()'s start, from the engine's plan and config (the values in use) and the argument that
    decided each; SFTConfig's default bf16=True is named as the reason for bf16 compute."""
    trl = pytest.importorskip("trl")
    from infinity.hf import InfinitySFTTrainer
    cfg = {"placement": {"params": "host", "grads": "device", "optimizer": "host"}, "zero": {"stage": 2},
           "optimizer": {"state_dtype": "bf16"}}
    trainer = InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path / "o", max_steps=3, eval_strategy="no",
                                                                max_grad_norm=0.25),
                              train_dataset=lm_dataset(16), infinity_config=cfg)
    capsys.readouterr()
    trainer.train()
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("infinity:")]
    plan = trainer.engine.plan
    assert plan.state_dtype.value == "bf16" and plan.compute_dtype == torch.float32
    assert said == ["infinity: compute fp32 (from TrainingArguments bf16=False), placement params=host grads=device "
                    "optimizer=host, ZeRO stage 2, grad clipping at norm 0.25 (max_grad_norm=0.25), optimizer adamw "
                    "state bf16, world size 1, device cpu"]
    trainer.engine.close()
    tokenizer, ds = chat_data(4)
    sft = InfinitySFTTrainer(model=tiny_llama(), train_dataset=ds, processing_class=tokenizer,
                             args=trl.SFTConfig(output_dir=str(tmp_path / "s"), use_cpu=True, report_to=[]))
    assert sft.engine.plan.compute_dtype == torch.bfloat16
    assert run_line(sft.args, sft.engine).startswith("infinity: compute bf16 (from SFTConfig bf16=True), ")
    sft.engine.close()


def test_infinity_profile_reads_a_trainers_output_dir_or_names_the_trainers_switch(tmp_path, capsys, monkeypatch):
    """With infinity_config's profiler on, train() writes output_dir/profile and `infinity profile OUTPUT_DIR` prints
    it; without, the hint is the trainer's own switch (a script has no --set)."""
    from infinity.job.cli import main
    from infinity.profile import chart
    monkeypatch.setattr(chart, "draw_timeline", lambda *a: False)  # (the PNG: not what is tested, 1 s of drawing)
    for enabled in (True, False):
        out = tmp_path / f"profile-{enabled}"
        trainer = InfinityTrainer(model=tiny_llama(), args=args_for(out, max_steps=1, eval_strategy="no"),
                                  train_dataset=lm_dataset(4), infinity_config={"profile": {"enabled": enabled}})
        if enabled:
            trainer.train()
        trainer.save_state()  # (trainer_state.json: what the output_dir of a run holds)
        capsys.readouterr()
        assert main(["profile", str(out)]) == (0 if enabled else 2)
        said = capsys.readouterr()
        if enabled:
            assert "profile rank 0: 1 step(s)" in said.out
        else:
            assert 'pass infinity_config={"profile": {"enabled": True}} to InfinityTrainer' in said.err
            assert "--set" not in said.err
        trainer.engine.close()


@pytest.mark.gpu
def test_gpu_losses_and_eval_equal_the_trainer(tmp_path):
    """The GPU twin (issue 42): InfinityTrainer against transformers' Trainer, both on the device."""
    test_losses_and_eval_equal_the_trainer(tmp_path, use_cpu=False)


def test_save_model_writes_the_files_trainer_writes(tmp_path):
    """`save_model` after training writes what transformers' Trainer writes, file name by file name: the model
    and its config and generation config, the training arguments, and the tokenizer with its chat template, taken
    from the data collator when there is no processing_class (Trainer._save's fallback), loadable by
    AutoTokenizer."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling
    tokenizer, _ = chat_data(4)
    train = lm_dataset(8, length=12)
    outputs = {}
    for cls in (Trainer, InfinityTrainer):
        out = tmp_path / cls.__name__
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = cls(model=tiny_llama(), args=args_for(out, max_steps=2, eval_strategy="no"), train_dataset=train,
                      data_collator=collator)
        trainer.train()
        trainer.save_model(str(out / "final"))
        outputs[cls] = out / "final"
        if cls is InfinityTrainer:
            trainer.engine.close()
    theirs, mine = ({p.name for p in outputs[c].iterdir()} for c in (Trainer, InfinityTrainer))
    assert mine == theirs, (sorted(mine ^ theirs), sorted(theirs))
    assert "tokenizer.json" in mine and "chat_template.jinja" in mine
    loaded = AutoTokenizer.from_pretrained(outputs[InfinityTrainer])
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded("hello world")["input_ids"] == tokenizer("hello world")["input_ids"]


def test_the_start_line_comes_before_the_progress_bar(tmp_path):
    """The trainer's start line is printed before transformers' progress bar starts (its callback runs first),
    so it stands above the bar instead of inside it."""
    from transformers.trainer_callback import ProgressCallback
    trainer = InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path / "o", max_steps=1, eval_strategy="no",
                                                                disable_tqdm=False), train_dataset=lm_dataset(4))
    names = [type(cb).__name__ for cb in trainer.callback_handler.callbacks]
    bar = next(i for i, cb in enumerate(trainer.callback_handler.callbacks) if isinstance(cb, ProgressCallback))
    assert names.index("_SayWhatRuns") < bar, names
    trainer.engine.close()



@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_kwargs_use_reentrant_is_accepted_and_changes_nothing(tmp_path, reentrant):
    """TRL and HF recipes pass gradient_checkpointing_kwargs={"use_reentrant": ...}: accepted, and the losses are
    those of gradient checkpointing without it (the engine recomputes whole units its own way)."""
    train = lm_dataset(16)
    plain = run(InfinityTrainer, tmp_path / "a", train, None, max_steps=4, eval_strategy="no",
                gradient_checkpointing=True)
    given = run(InfinityTrainer, tmp_path / "b", train, None, max_steps=4, eval_strategy="no",
                gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    assert losses(given) == losses(plain)
    assert given.engine.config.activation.checkpoint == "units"
    for t in (plain, given):
        t.engine.close()


def test_trainer_model_keeps_its_dtype_and_holds_the_trained_weights(tmp_path):
    """Note [the user's model]: with SFTConfig's default bf16=True, TRL's trainer.model stays fp32 (autocast) and
    after train() holds the trained weights, norm weights moved by less than bf16's spacing near 1.0 included; so
    does ours (the engine's fp32 masters, exactly). With bf16=False the weights are TRL's."""
    tokenizer, ds = chat_data(8)
    ref, ours = sft_beside_trl(tmp_path / "bf16", tokenizer, ds, max_steps=2, learning_rate=1e-5, bf16=True)
    start = dict(tiny_llama().named_parameters())
    assert ours.model.dtype == ref.model.dtype == torch.float32
    moved = {n for n, p in ref.model.named_parameters() if not torch.equal(p, start[n])}
    assert {n for n, p in ours.model.named_parameters() if not torch.equal(p, start[n])} == moved == set(start)
    norm = ours.model.model.norm.weight
    assert 0 < (norm - 1).abs().max() < 2 ** -8  # below bf16's spacing near 1.0: seen only at fp32
    masters = ours.engine.full_state_dict()
    assert all(torch.equal(p, masters[n]) for n, p in ours.model.named_parameters())
    ours.engine.close()
    ref, ours = sft_beside_trl(tmp_path / "fp32", tokenizer, ds, max_steps=2, bf16=False)
    theirs = dict(ref.model.named_parameters())
    for name, param in ours.model.named_parameters():
        torch.testing.assert_close(param, theirs[name], rtol=1e-4, atol=1e-6)
    ours.engine.close()


def test_evaluate_and_save_see_the_trained_weights(tmp_path):
    """At each evaluation and save during train(), trainer.model holds the weights being saved (a callback reads
    it at the save: the checkpoint's exported weights are trainer.model's)."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback
    seen = {}

    class Snapshot(TrainerCallback):
        def on_save(self, args, state, control, model=None, **kwargs):
            seen[state.global_step] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    trainer = InfinityTrainer(model=tiny_llama(), args=args_for(tmp_path / "o", max_steps=4, eval_strategy="no",
                                                                save_strategy="steps", save_steps=2),
                              train_dataset=lm_dataset(16), callbacks=[Snapshot()])
    trainer.train()
    for step in (2, 4):
        saved = load_file(tmp_path / "o" / f"checkpoint-{step}" / "model.safetensors")
        assert set(saved) <= set(seen[step])
        assert all(torch.equal(saved[k], seen[step][k]) for k in saved)
    assert not torch.equal(seen[2]["model.norm.weight"], seen[4]["model.norm.weight"])
    trainer.engine.close()


def test_model_init_kwargs_dtype_is_the_models(tmp_path):
    """SFTConfig(model_init_kwargs={"dtype": torch.float16}) with a model path: trainer.model is float16, as TRL's
    (the engine computes in the compute dtype on its own copies)."""
    trl = pytest.importorskip("trl")
    from infinity.hf import InfinitySFTTrainer
    tokenizer, ds = chat_data(4)
    tiny_llama().save_pretrained(tmp_path / "base")
    dtypes = {}
    for cls in (trl.SFTTrainer, InfinitySFTTrainer):
        cfg = trl.SFTConfig(output_dir=str(tmp_path / cls.__name__), model_init_kwargs={"dtype": torch.float16},
                            max_steps=1, per_device_train_batch_size=2, report_to=[], save_strategy="no",
                            use_cpu=True, disable_tqdm=True, max_length=32)
        trainer = cls(model=str(tmp_path / "base"), args=cfg, train_dataset=ds, processing_class=tokenizer)
        trainer.train()
        dtypes[cls] = trainer.model.dtype
        if cls is InfinitySFTTrainer:
            trainer.engine.close()
    assert dtypes[InfinitySFTTrainer] == dtypes[trl.SFTTrainer] == torch.float16


@pytest.mark.parametrize("method", ["prompt_tuning", "p_tuning"])
def test_prompt_learning_trains_and_saves_what_trl_saves(tmp_path, method):
    """PEFT prompt learning (Note [prompt embeddings] in state/export.py): the losses and the saved
    adapter_model.safetensors (`prompt_embeddings`, computed by PEFT from the trained encoder) are TRL's."""
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file
    tokenizer, ds = chat_data(8)
    config = (peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4) if method == "prompt_tuning" else
              peft.PromptEncoderConfig(task_type="CAUSAL_LM", num_virtual_tokens=4, encoder_hidden_size=16))
    trl = pytest.importorskip("trl")
    from infinity.hf import InfinitySFTTrainer
    runs = {}
    for cls in (trl.SFTTrainer, InfinitySFTTrainer):
        torch.manual_seed(0)  # (the prompt encoder's initial weights)
        cfg = trl.SFTConfig(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=2, learning_rate=1e-2,
                            logging_steps=1, save_strategy="steps", save_steps=2, report_to=[], seed=3, use_cpu=True,
                            disable_tqdm=True, max_length=32, max_steps=2, bf16=False)
        trainer = cls(model=tiny_llama(), args=cfg, train_dataset=ds, processing_class=tokenizer, peft_config=config)
        trainer.train()
        runs[cls] = trainer
    ref, ours = runs[trl.SFTTrainer], runs[InfinitySFTTrainer]
    torch.testing.assert_close(torch.tensor(losses(ours)), torch.tensor(losses(ref)), rtol=1e-5, atol=0)
    theirs = load_file(tmp_path / "SFTTrainer" / "checkpoint-2" / "adapter_model.safetensors")
    mine = load_file(tmp_path / "InfinitySFTTrainer" / "checkpoint-2" / "adapter_model.safetensors")
    assert set(mine) == set(theirs) == {"prompt_embeddings"}
    torch.testing.assert_close(mine["prompt_embeddings"], theirs["prompt_embeddings"], rtol=1e-4, atol=1e-6)
    ours.engine.close()


def test_trainer_model_follows_train_and_eval_mode_as_trls(tmp_path):
    """TRL reads `self.model.training` to file its metrics under train or eval: trainer.model (the user's, Note [the
    user's model]) is in train mode during train() and in eval mode in evaluate(), as with TRL's own trainer; a
    model loaded in eval mode logs the same training metrics (entropy, token accuracy) as TRL's."""
    trl = pytest.importorskip("trl")
    from transformers import TrainerCallback

    from infinity.hf import InfinitySFTTrainer
    tokenizer, ds = chat_data(8)
    modes, logged = {}, {}

    class Mode(TrainerCallback):
        def __init__(self, name):
            self.name = name

        def on_step_end(self, args, state, control, model=None, **kwargs):
            modes.setdefault(self.name, []).append(trainers[self.name].model.training)

    trainers = {}
    for cls in (trl.SFTTrainer, InfinitySFTTrainer):
        cfg = trl.SFTConfig(output_dir=str(tmp_path / cls.__name__), per_device_train_batch_size=2, max_steps=2,
                            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                            max_length=32, bf16=False)
        trainer = trainers[cls.__name__] = cls(model=tiny_llama().eval(), args=cfg, train_dataset=ds, eval_dataset=ds,
                                               processing_class=tokenizer, callbacks=[Mode(cls.__name__)])
        trainer.train()
        trainer.evaluate()
        logged[cls.__name__] = [sorted(h) for h in trainer.state.log_history]
        modes[cls.__name__].append(trainer.model.training)
    assert modes["InfinitySFTTrainer"] == modes["SFTTrainer"]
    assert logged["InfinitySFTTrainer"] == logged["SFTTrainer"]
    trainers["InfinitySFTTrainer"].engine.close()
