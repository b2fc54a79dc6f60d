"""Chunked logits loss (Note [chunked loss]): loss and gradients equal the unchunked Hugging Face model's.

The reference is the model's own forward with labels (transformers' ForCausalLMLoss over the whole logits
tensor) and plain torch autograd; the chunked loss must match it at fp32 tolerances, for Llama and GPT-2
(tied embeddings), with -100 labels, alone and through the engine with parameters on NVMe.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

transformers = __import__("transformers") if os.environ.get("CI") else pytest.importorskip("transformers")

import infinity  # noqa: E402
from adam_tolerance import assert_close_after_adam  # noqa: E402
from infinity.config.options import ConfigError  # noqa: E402
from infinity.config.sections import ActivationConfig  # noqa: E402
from infinity.runtime.chunked_loss import chunked_cross_entropy, loss_forward  # noqa: E402

VOCAB, SEQ = 97, 16


def gpt2():
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=None, eos_token_id=None))


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=None, eos_token_id=None, pad_token_id=None))


def labelled_batch(seed=3, batch=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    labels = x.clone()
    labels[0, :5] = -100  # a prompt that is not trained on
    labels[2, 9:] = -100  # padding
    return x, labels


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("chunk", [5, 16, 1000])
def test_chunked_loss_and_gradients_equal_the_models_own(build, chunk):
    model = build()
    x, labels = labelled_batch()
    ref = model(input_ids=x, labels=labels).loss  # transformers' ForCausalLMLoss over the full logits
    ref.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    out = loss_forward(ActivationConfig(loss_chunk_tokens=chunk), model)(input_ids=x, labels=labels)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-6)
    got = grads(model)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_num_items_in_batch_is_transformers_sum_over_it():
    """Note [token-weighted windows]: with num_items_in_batch the chunked loss is the model's own (the summed
    cross-entropy over it), loss and gradients (the Trainer passes it whenever the model accepts it)."""
    model = llama()
    x, labels = labelled_batch()
    ref = model(input_ids=x, labels=labels, num_items_in_batch=torch.tensor(37)).loss
    ref.backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    out = loss_forward(ActivationConfig(loss_chunk_tokens=5), model)(input_ids=x, labels=labels,
                                                                     num_items_in_batch=torch.tensor(37))
    out.loss.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-6, atol=1e-6)
    for name, value in grads(model).items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_cross_entropy_against_a_written_out_formula():
    torch.manual_seed(1)
    h = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    head = torch.nn.Linear(8, 13, bias=True).double()
    y = torch.randint(0, 13, (10,))
    y[[2, 7]] = -100
    loss = chunked_cross_entropy(h, head, y, 3)
    keep = y != -100
    logits = h[keep] @ head.weight.T + head.bias
    ref = (torch.logsumexp(logits, -1) - logits.gather(1, y[keep, None]).squeeze(1)).sum() / keep.sum()
    torch.testing.assert_close(loss.double(), ref)
    gh, gw, gb = torch.autograd.grad(loss, [h, head.weight, head.bias])
    rh, rw, rb = torch.autograd.grad(ref, [h, head.weight, head.bias])
    for a, b in ((gh, rh), (gw, rw), (gb, rb)):
        torch.testing.assert_close(a, b)


def test_no_labels_runs_the_models_forward_and_returns_logits():
    model = llama()
    x, _ = labelled_batch()
    out = loss_forward(ActivationConfig(loss_chunk_tokens=4), model)(input_ids=x)
    torch.testing.assert_close(out.logits, model(input_ids=x).logits)


def test_models_the_chunked_loss_cannot_reproduce_are_refused_with_the_fix():
    model = llama()
    model.config.final_logit_softcapping = 30.0  # Gemma 2's head: tanh soft-capping of the logits
    with pytest.raises(ConfigError, match="final_logit_softcapping.*loss_chunk_tokens = 0"):
        loss_forward(ActivationConfig(loss_chunk_tokens=8), model)
    with pytest.raises(ConfigError, match="not a Hugging Face causal LM.*chunked_loss_parts"):
        loss_forward(ActivationConfig(loss_chunk_tokens=8), torch.nn.Linear(2, 2))


@pytest.mark.parametrize("build", [llama, gpt2], ids=["llama", "gpt2"])
def test_through_the_engine_with_params_on_nvme_equals_unchunked_training(build, tmp_path, on_device=False):
    """`on_device` (the GPU twin): the engine's loss and update on the GPU, the reference's on the CPU: the losses
    within 1e-4 relative, the parameters within the Adam tolerance (adam_tolerance.py)."""
    opt = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0}
    placement = {"params": "nvme", "grads": "host", "optimizer": "nvme"}
    model = build()
    ref_model = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=opt["lr"], betas=opt["betas"], eps=opt["eps"],
                                weight_decay=opt["weight_decay"])
    cfg = {"optimizer": opt, "placement": placement, "nvme": {"paths": [str(tmp_path)]},
           "activation": {"loss_chunk_tokens": 7}}
    with infinity.initialize(model, cfg) as engine:
        for seed in range(3):
            x, labels = labelled_batch(seed)
            ref = ref_model(input_ids=x, labels=labels).loss
            ref.backward()
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), opt["grad_clip"])
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            loss = engine(input_ids=x, labels=labels).loss
            engine.backward(loss)
            engine.step()
            torch.testing.assert_close(loss.detach().cpu(), ref.detach(), rtol=1e-4 if on_device else 1e-5, atol=1e-6)
        state = engine.full_state_dict()
    want = {name: value for name, value in ref_model.state_dict().items() if name in state}
    if on_device:
        assert_close_after_adam(state, want, steps=3, lr=opt["lr"])
        return
    for name, value in want.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_the_training_job_with_loss_chunk_tokens_gives_the_unchunked_jobs_losses(tmp_path, monkeypatch):
    from infinity.job.spec import load_job
    from infinity.job.train import train
    from infinity.runtime import chunked_loss
    calls = []

    def counted(*args):
        calls.append(args[3])  # chunk_tokens
        return chunked_cross_entropy(*args)
    monkeypatch.setattr(chunked_loss, "chunked_cross_entropy", counted)

    def losses(chunk, name):
        job = load_job(None, ["model.kind=llama", "model.n_layer=1", "model.d_model=32", "model.n_head=4",
                              "model.seq_len=32", "run.batch_size=2", "run.steps=3", "run.eval_every=0",
                              "run.eval_batches=1", f"run.dir={tmp_path}", f"run.name={name}",
                              f"activation.loss_chunk_tokens={chunk}"])
        assert train(job, verbose=False).status == "completed"
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [__import__("json").loads(line)["loss"] for line in lines]
    off = losses(0, "off")
    assert not calls
    assert losses(10, "chunked") == pytest.approx(off, rel=1e-5)
    assert calls and set(calls) == {10}  # the job's steps (and validation) went through the chunked loss


def test_estimate_counts_the_logits_the_chunked_loss_does_not_keep():
    from infinity.config.job import ModelConfig
    from infinity.config.sections import Config
    from infinity.models.build import build_model
    from infinity.plan.estimate import estimate
    vocab, seq = 4096, 64
    model = ModelConfig(kind="llama", vocab_size=vocab, d_model=16, n_layer=1, n_head=2, seq_len=seq)

    def saved(chunk):
        config = Config.from_dict({"activation": {"loss_chunk_tokens": chunk}})
        est = estimate(lambda: build_model(model), config, batch_size=2, seq_len=seq, cuda=False)
        return est.trace.activation_bytes
    # off, autograd keeps the fp32 log-softmax of the logits [2, seq, vocab] (the head saves its input, already
    # counted); chunked, the hidden states and labels (a few bytes more than nothing)
    assert saved(0) - saved(16) == pytest.approx(2 * seq * vocab * 4, rel=0.01)


def test_a_tiled_head_is_refused_naming_tile_bytes():
    """An opt-in model's head over [units] tile_bytes is a TiledLinear: the chunked loss says so, not AttributeError."""
    from infinity.units.tiling import tile_layers
    model = torch.nn.Sequential(torch.nn.Linear(8, 64))
    tile_layers(model, 512, 4)
    with pytest.raises(ValueError, match="head must be a plain nn.Linear, got a TiledLinear.*tile_bytes"):
        chunked_cross_entropy(torch.randn(2, 3, 8), model[0], torch.zeros(2, 3, dtype=torch.long), 4)


@pytest.mark.gpu
def test_gpu_chunked_loss_through_the_engine_equals_unchunked_training(tmp_path):
    """The GPU twin (issue 42): the chunked loss of a Llama with its parameters on NVMe, on the device."""
    test_through_the_engine_with_params_on_nvme_equals_unchunked_training(llama, tmp_path, on_device=True)
