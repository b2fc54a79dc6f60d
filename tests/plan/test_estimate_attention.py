"""Note [fused attention] (infinity/plan/traced.py): the estimator's trace saves what a real run's fused
attention saves. The reference is a real run of the same model on the CPU, where torch's dispatch picks its fused
(flash) kernel: every tensor autograd saves, counted as the trace counts them. On meta tensors the dispatch could only
pick the math kernel, whose b x h x s x s probabilities made the estimate two thirds larger here."""

from __future__ import annotations

import pytest
import torch

from infinity.config.job import ModelConfig
from infinity.plan.traced import job_depth, trace_step

SEQ, BATCH = 256, 2  # (long enough for the probabilities to show: 4 heads x 256 x 256 per sequence and block)


def saved_by_a_real_run(net: torch.nn.Module, loss_fn, x: torch.Tensor) -> int:
    """Bytes autograd saves in one forward of `net` on the CPU (its parameters excluded)."""
    params = {id(p) for p in net.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(t) not in params and id(base) not in params:
            saved[id(base)] = base.numel() * base.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(net, x, x)
    return sum(saved.values())


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["grouped-query", "multi-head"])
def test_the_estimators_llama_trace_saves_what_a_real_run_saves(kv_heads):
    model = ModelConfig(kind="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=kv_heads, seq_len=SEQ,
                        vocab_size=300)
    depth = job_depth(model, own_llama=True)
    real_model = depth.build(2)
    net = real_model.model.to_empty(device="cpu")
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0.0, 0.02)
    real = saved_by_a_real_run(net, real_model.loss, torch.zeros(BATCH, SEQ, dtype=torch.long))
    traced = depth.build(2)
    trace = trace_step(traced.model, traced.loss, BATCH, SEQ)
    assert trace.error is None and trace.activation_bytes == real, (trace.activation_bytes, real)


def test_a_hugging_face_llamas_trace_saves_what_a_real_run_saves():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    loss_fn = lambda m, x, y: m(input_ids=x, labels=y).loss  # noqa: E731
    real = saved_by_a_real_run(LlamaForCausalLM(cfg), loss_fn, torch.zeros(BATCH, SEQ, dtype=torch.long))
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    trace = trace_step(meta, loss_fn, BATCH, SEQ)
    assert trace.error is None and trace.activation_bytes == real, (trace.activation_bytes, real)
