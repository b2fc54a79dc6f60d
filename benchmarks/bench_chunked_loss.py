"""Chunked logits loss (`[activation] loss_chunk_tokens`, Note [chunked loss]): peak RSS of a fine-tune step.

A large-vocabulary tiny Llama (vocab 128k, hidden 64, 2 layers, seq 2048, batch 1) trains a few steps
through the engine (everything on the device tier, here the CPU), each variant in its own fresh process so
that its peak RSS (ru_maxrss) is its own; medians of `--repeats` processes per variant, alternating.

    python benchmarks/bench_chunked_loss.py --json            # off vs loss_chunk_tokens = 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, resource, sys, time, torch, transformers, infinity
vocab, hidden, seq, steps, chunk = (int(a) for a in sys.argv[1:6])
torch.manual_seed(0)
with infinity.meta_init():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=seq, bos_token_id=None, eos_token_id=None,
        pad_token_id=None, loss_type="ForCausalLM"))
cfg = {"optimizer": {"lr": 1e-3}, "activation": {"loss_chunk_tokens": chunk}}
g = torch.Generator().manual_seed(1)
times, losses = [], []
with infinity.initialize(model, cfg, init_fn=model._init_weights) as engine:
    for _ in range(steps):
        x = torch.randint(0, vocab, (1, seq), generator=g)
        t = time.perf_counter()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": times,
                  "losses": losses}))
"""


def run(args, chunk: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.vocab), str(args.hidden), str(args.seq),
                          str(args.steps), str(chunk)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_000)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    began = time.perf_counter()
    runs: dict[str, list[dict]] = {"off": [], "chunked": []}
    for _ in range(args.repeats):
        runs["off"].append(run(args, 0))
        runs["chunked"].append(run(args, args.chunk))
    result = {"vocab": args.vocab, "hidden": args.hidden, "seq": args.seq, "chunk": args.chunk,
              "repeats": args.repeats, "seconds": round(time.perf_counter() - began, 1)}
    for name, rs in runs.items():
        result[name] = {"peak_rss_MiB": statistics.median(r["peak_rss"] for r in rs) / 2**20,
                        "step_s": statistics.median(statistics.median(r["step_s"]) for r in rs),
                        "first_loss": rs[0]["losses"][0]}
    result["peak_drop_MiB"] = result["off"]["peak_rss_MiB"] - result["chunked"]["peak_rss_MiB"]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for name in runs:
            r = result[name]
            print(f"{name:8s} peak RSS {r['peak_rss_MiB']:8.0f} MiB  step {r['step_s']:.2f} s  "
                  f"loss {r['first_loss']:.4f}")
        print(f"peak drop {result['peak_drop_MiB']:.0f} MiB")


if __name__ == "__main__":
    main()
