"""Chunked logits loss: the output head and the cross-entropy over chunks of tokens, so that the full
[batch, seq, vocab] logits tensor never exists (`[activation] loss_chunk_tokens`).

Note [chunked loss]: a causal LM's loss is mean_t CE(h_t @ W^T (+ b), y_t) over the tokens whose label is
not -100. The logits of a 128k vocabulary over 4k tokens are 2 GiB per sample in fp32, and autograd keeps
them (and their fp32 upcast) for backward. `chunked_cross_entropy` computes the same sum chunk by chunk
in forward, keeping only the hidden states, and recomputes each chunk's logits in backward to get the
chunk's gradients (an autograd.Function: one extra head matmul of compute, one chunk of logits alive at a
time). Each chunk runs exactly the ops transformers' ForCausalLMLoss runs on its rows (head in the model's
dtype, upcast to fp32, cross_entropy with ignore_index=-100), summed and divided by the number of
unmasked tokens, so loss and gradients equal the unchunked model's up to fp32 summation order.

For Hugging Face causal LMs the engine (`loss_forward`) runs the decoder (the model's `base_model_prefix`
attribute: `model.model`, `transformer`) for the hidden states and applies the head's weight itself; the
head lives in the root unit, unsharded while the forward and backward run, and gets its gradient as usual
(tied embeddings, as GPT-2's, are one parameter: autograd sums both uses). Models whose head does more than
a Linear (logit soft-capping, logit scaling) are refused with the fix, since the chunked loss could not
reproduce them. A caller learns whether the forward chunks from `chunks_loss` on it (or on
`engine.forward_fn`): the job then passes its labels, and otherwise computes the loss from the logits as
before (passing `shift_labels` to an unchunked model needs transformers >= 4.50). Any other model opts
in with a method `chunked_loss_parts(*args, **kwargs)` returning (hidden states [..., hidden], head
nn.Linear, shifted labels [...]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from infinity.config.options import ConfigError

__all__ = ["IGNORE_INDEX", "chunked_cross_entropy", "loss_forward", "logits_bytes_saved", "token_loss"]

IGNORE_INDEX = -100
# config attributes of heads that are not a plain Linear (Gemma 2/3 soft-capping, Cohere and Granite scaling)
_HEAD_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """sum over chunks of CE(F.linear(hidden, weight, bias).float(), targets, reduction="sum") / count (the
    unmasked targets, or the window's items: Note [token-weighted windows] in accumulation.py)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk: int, num_items):
        count = (targets != IGNORE_INDEX).sum() if num_items is None else torch.as_tensor(num_items).to(hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[s:s + chunk], weight, bias).float()
            total += F.cross_entropy(logits, targets[s:s + chunk], ignore_index=IGNORE_INDEX, reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, targets, count)
        ctx.chunk = chunk
        return total / count

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, targets, count = ctx.saved_tensors
        scale = grad / count
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if need_b else None
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk].detach().requires_grad_(need_h)
            with torch.enable_grad():
                logits = F.linear(h, w, b).float()
                loss = F.cross_entropy(logits, targets[s:s + ctx.chunk], ignore_index=IGNORE_INDEX, reduction="sum")
            inputs = [t for t, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
            grads = iter(torch.autograd.grad(loss, inputs, scale))
            if need_h:
                grad_h[s:s + ctx.chunk] = next(grads)
            if need_w:
                grad_w += next(grads)
            if need_b:
                grad_b += next(grads)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None)


def token_loss(logits: torch.Tensor, targets: torch.Tensor, num_items=None) -> torch.Tensor:
    """Cross-entropy of `logits` against `targets` (already the next tokens; -100: ignored) as transformers'
    ForCausalLMLoss computes it: fp32, the mean over the unmasked targets, or with `num_items` their sum over
    it (Note [token-weighted windows] in accumulation.py)."""
    flat = logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1).to(logits.device)
    if num_items is None:
        return F.cross_entropy(*flat, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(*flat, ignore_index=IGNORE_INDEX, reduction="sum") / num_items


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Linear, shift_labels: torch.Tensor,
                          chunk_tokens: int, num_items=None) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against `shift_labels` (-100: ignored), `chunk_tokens` rows of
    logits at a time (Note [chunked loss]); with `num_items` the summed cross-entropy over it, as
    transformers' `num_items_in_batch`. hidden: [..., hidden]; shift_labels: [...], already shifted."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = shift_labels.reshape(-1).to(h.device)
    if y.numel() != h.shape[0]:
        raise ValueError(f"chunked loss: {h.shape[0]} hidden states but {y.numel()} labels")
    if not isinstance(head, nn.Linear):
        raise ValueError(f"chunked loss: the head must be a plain nn.Linear, got a {type(head).__name__} (a head "
                         f"over [units] tile_bytes is tiled: raise tile_bytes above the head's size, or set "
                         f"activation.loss_chunk_tokens = 0)")
    return _ChunkedCrossEntropy.apply(h, head.weight, head.bias, y, int(chunk_tokens), num_items)


def _shifted(labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor:
    """Labels shifted as ForCausalLMLoss shifts them (tokens < n predict n; the last position is ignored)."""
    if shift_labels is not None:
        return shift_labels
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers PreTrainedModel inside `model` (a PEFT wrapper's base model), or `model`."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


class HFChunkedLoss:
    """A Hugging Face causal LM's forward with labels, its loss chunked: the decoder for the hidden states,
    then `chunked_cross_entropy` with the head (Note [chunked loss])."""

    chunks_loss = True  # (what a caller asks to know whether to pass labels: Note [chunked loss])

    def __init__(self, model: nn.Module, chunk_tokens: int):
        self.model, self.chunk_tokens = model, chunk_tokens
        lm = _causal_lm(model)
        cfg = lm.config
        name = type(lm).__name__
        extras = {k: getattr(cfg, k) for k in _HEAD_EXTRAS if getattr(cfg, k, None) not in (None, 1, 1.0)}
        if extras:
            raise ConfigError(f"activation.loss_chunk_tokens = {chunk_tokens}: {name}'s head applies "
                              f"{', '.join(f'{k} = {v}' for k, v in extras.items())} to its logits, which the "
                              f"chunked loss does not reproduce; set activation.loss_chunk_tokens = 0 for this model")
        head = lm.get_output_embeddings()
        if type(head) is not nn.Linear:
            raise ConfigError(f"activation.loss_chunk_tokens = {chunk_tokens}: {name}'s output head is a "
                              f"{type(head).__name__}, not a plain nn.Linear (e.g. LoRA on lm_head); remove the "
                              f"adapter from the head, or set activation.loss_chunk_tokens = 0")
        self.decoder = getattr(lm, lm.base_model_prefix)
        self.head = head
        self.vocab_size = cfg.vocab_size

    def __call__(self, *args, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs) -> Any:
        if labels is None and shift_labels is None:
            return self.model(*args, **kwargs)  # no loss asked: the model's own forward (e.g. evaluation logits)
        kwargs.pop("logits_to_keep", None)
        out = self.decoder(*args, **kwargs)
        loss = chunked_cross_entropy(out[0], self.head, _shifted(labels, shift_labels), self.chunk_tokens,
                                     num_items_in_batch)
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(loss=loss, logits=None)


class OptInChunkedLoss:
    """A model with `chunked_loss_parts(*args, **kwargs) -> (hidden, head, shift_labels)`: returns the loss."""

    chunks_loss = True

    def __init__(self, model: nn.Module, chunk_tokens: int):
        self.model, self.chunk_tokens = model, chunk_tokens

    def __call__(self, *args, **kwargs) -> Any:
        hidden, head, shift_labels = self.model.chunked_loss_parts(*args, **kwargs)
        return chunked_cross_entropy(hidden, head, shift_labels, self.chunk_tokens)


def loss_forward(activation, model: nn.Module):
    """What a forward call runs: the model itself, or with `[activation] loss_chunk_tokens` its chunked-loss
    forward (refused, with the fix, for a model that neither is a transformers causal LM nor opts in)."""
    chunk = activation.loss_chunk_tokens
    if not chunk:
        return model
    if callable(getattr(model, "chunked_loss_parts", None)):
        return OptInChunkedLoss(model, chunk)
    lm = _causal_lm(model)
    if callable(getattr(lm, "get_output_embeddings", None)) and hasattr(lm, "base_model_prefix"):
        return HFChunkedLoss(model, chunk)
    raise ConfigError(f"activation.loss_chunk_tokens = {chunk}: {type(model).__name__} is not a Hugging Face "
                      f"causal LM and has no chunked_loss_parts(...) method, so its loss cannot be chunked; set "
                      f"activation.loss_chunk_tokens = 0, or give the model chunked_loss_parts (Note [chunked loss])")


def kept_whole(forward) -> tuple[nn.Module, ...]:
    """The modules `forward` (from `loss_forward`) reads whole, which tiling must leave as they are (Note [tiles are
    units]): an HF chunked loss's head; nothing for the model itself, whatever its attributes are called."""
    return (forward.head,) if isinstance(forward, HFChunkedLoss) else ()


def logits_bytes_saved(batch: int, seq_len: int, vocab: int, chunk_tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes of logits the chunked loss does not keep: the [batch, seq, vocab] logits and their fp32 upcast
    (one copy when the model computes in fp32) less one chunk's of each, alive only while it is computed."""
    per_token = vocab * (dtype_bytes + (4 if dtype_bytes != 4 else 0))
    return max(0, batch * seq_len - chunk_tokens) * per_token
