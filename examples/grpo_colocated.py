"""GRPO beside an inference engine on one device: a tiny Llama learns to add (docs/rl.md).

    pip install transformers
    python examples/grpo_colocated.py                  # ~200 iterations, a minute or two on a CPU
    python examples/grpo_colocated.py --iterations 2   # a smoke run

The policy (a 2-layer Llama built from a config: nothing downloaded) sees prompts "a+b=" (a, b in 0..4) and
answers one token; the reward is 1 for the right sum, 0 otherwise (verifiable, no reward model). Each
iteration is the colocated RL loop:

1. the trainer's weights go to the rollout model (a second `LlamaForCausalLM`, standing in for vLLM / SGLang)
   through `engine.named_full_parameters()`, one unit at a time;
2. the trainer leaves the device: `engine.offload_states()` (parameters, gradients, optimizer state, buffers);
3. the rollout model samples GROUP answers per prompt with transformers' `generate`; rewards are checked;
4. the trainer comes back: `engine.reload_states()`; one GRPO update: advantages are the rewards normalized in
   each prompt's group, loss = -mean(advantage * log p(answer)) (on-policy, one update per batch: the
   clipped ratio is 1 and its gradient is the policy gradient's; no KL term, TRL's default beta = 0).

Prints the mean reward per iteration (it rises from chance, ~1/12, towards 1); `--out FILE` writes the curve.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import infinity

DIGITS = [str(d) for d in range(10)]
VOCAB = DIGITS + ["+", "="]  # token ids: a digit is its own id
PLUS, EQUALS = VOCAB.index("+"), VOCAB.index("=")


def policy_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None)


def prompts(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n prompts "a+b=" as token ids, and their answers a + b."""
    a, b = torch.randint(0, 5, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)
    ids = torch.stack([a, torch.full_like(a, PLUS), b, torch.full_like(a, EQUALS)], dim=1)
    return ids, a + b


def push_weights(engine, rollout: LlamaForCausalLM) -> None:
    """The trainer's current weights into the rollout model, one unit's tensors at a time (an inference
    engine's `load_weights(engine.named_full_parameters())` does the same)."""
    params = dict(rollout.named_parameters())
    with torch.no_grad():
        for name, value in engine.named_full_parameters():
            params[name].copy_(value)


def answer_logprobs(engine, sequences: torch.Tensor) -> torch.Tensor:
    """log p(answer | prompt) under the trainer's policy: the last token of each sequence."""
    logits = engine(input_ids=sequences[:, :-1]).logits[:, -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, sequences[:, -1:]).squeeze(1)


def main(argv=None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=200)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per iteration")
    ap.add_argument("--group", type=int, default=8, help="answers sampled per prompt")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile-dir", default=None, help="write the trainer's profile here (offload / reload spans)")
    ap.add_argument("--out", default=None, help="write the reward curve here (JSON)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    initial = LlamaForCausalLM(policy_config())  # the starting policy's weights (random: learned from scratch)
    with infinity.meta_init():
        policy = LlamaForCausalLM(policy_config())
    config = {"placement": {"params": "device", "grads": "device", "optimizer": "device"},  # the device is shared
              "precision": {"compute_dtype": "fp32"},
              "optimizer": {"lr": args.lr, "weight_decay": 0.0, "grad_clip": 1.0, "betas": [0.9, 0.99]},
              "overlap": {"optimizer_with_backward": False},
              "profile": {"enabled": args.profile_dir is not None, "trace_dir": args.profile_dir or "profile"}}
    engine = infinity.initialize(policy, config, weights=initial.state_dict())
    rollout = LlamaForCausalLM(policy_config()).eval()  # the inference side: its own copy of the weights
    g, curve, start = torch.Generator().manual_seed(args.seed + 1), [], time.perf_counter()
    try:
        for it in range(args.iterations):
            push_weights(engine, rollout)
            engine.offload_states()  # rollouts own the device now
            ids, answers = prompts(args.prompts, g)
            ids, answers = ids.repeat_interleave(args.group, 0), answers.repeat_interleave(args.group, 0)
            with torch.no_grad():
                sequences = rollout.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                                             do_sample=True, top_k=0, temperature=1.0, pad_token_id=0)
            rewards = (sequences[:, -1] == answers).float()
            grouped = rewards.view(args.prompts, args.group)
            advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
            engine.reload_states()  # the trainer's turn
            loss = -(advantages * answer_logprobs(engine, sequences)).mean()
            engine.backward(loss)
            engine.step()
            curve.append(rewards.mean().item())
            if it % 10 == 0 or it == args.iterations - 1:
                print(f"iteration {it:4d}  reward {curve[-1]:.3f}  ({time.perf_counter() - start:.0f} s)", flush=True)
    finally:
        engine.close()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(curve, f)
    return curve


if __name__ == "__main__":
    main()
