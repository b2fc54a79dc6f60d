"""Tiny Hugging Face causal LMs (no download) saved the ways a user has them, for the weights= and export tests.

The reference is always transformers itself: the same config built and run by transformers (eval mode,
fp32), its own save_pretrained files, its own from_pretrained.
"""

from __future__ import annotations

import os

import pytest
import torch

transformers = __import__("transformers") if os.environ.get("CI") else pytest.importorskip("transformers")

import infinity  # noqa: E402

VOCAB, SEQ = 96, 16
# fp32 compute, updates on the training thread: the engine's forward is transformers' own maths
HOST = {"placement": {"params": "host", "grads": "host", "optimizer": "host"},
        "precision": {"compute_dtype": "fp32"}, "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
        "overlap": {"optimizer_with_backward": False}}


def bpe_tokenizer(texts, vocab_size: int = 300, specials=("</s>",)):
    """A byte-level BPE tokenizer trained here on `texts` (no download), EOS and padding "</s>"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")


def nvme(swap: str) -> dict:
    return {**HOST, "placement": {"params": "nvme", "grads": "host", "optimizer": "nvme"}, "nvme": {"paths": [swap]}}


def config(kind: str, layers: int = 2, hidden: int = 64):
    if kind == "llama":
        return transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
    return transformers.GPT2Config(  # ties lm_head to wte
        vocab_size=VOCAB, n_positions=SEQ, n_embd=hidden, n_layer=layers, n_head=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


def model_class(kind: str):
    return transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel


def reference(kind: str, seed: int = 0, **shape):
    """transformers' own model, randomly initialized by transformers."""
    torch.manual_seed(seed)
    return model_class(kind)(config(kind, **shape)).eval()


def on_meta(kind: str, **shape):
    with infinity.meta_init():
        return model_class(kind)(config(kind, **shape))


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def logits(forward) -> torch.Tensor:
    with torch.no_grad():
        return forward(input_ids=prompt()).logits.float()


def train(engine, steps: int = 2) -> None:
    """A few steps, so the weights (and LoRA's B) are no longer their initial values."""
    x = prompt()
    for _ in range(steps):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
