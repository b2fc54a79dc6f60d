"""How long `infinity estimate` takes for a 70B Llama, as a user runs it (issue 44: under 5 s).

Two configs, each estimated in a fresh process (`infinity estimate`, the console script) `--repeats` times,
alternating: a `[model]` Llama shape of Llama 2 70B's size (`--model llama --set model.*`), and a pretrained
directory holding only Llama-2-70B's config.json (`--set model.pretrained=DIR --set model.tokenizer=bytes`:
the estimate also searches LoRA plans for it). With `--before DIR` (a checkout of another commit, e.g. `git
worktree add /tmp/before <commit>`), that checkout's estimates run interleaved with these, each as `python -m
infinity.job.cli` from its directory. Reported: wall and CPU (user + system of the finished child) per run,
and their medians; the estimate's exit status is 1 here (a 70B does not fit this machine), which is its answer.

    python benchmarks/bench_estimate.py --repeats 5 --json estimate.json [--before /tmp/before]

With `--accuracy` it measures instead how far the estimate's predictions are from a run's measurements (Note
[estimate error]): for each model source (`gpt`: the built-in GPT; `llama`: a transformers Llama of a given shape,
`model.kind=llama`; `pretrained`: a tiny Llama saved with its tokenizer, fine-tuned whole; `pretrained-lora`: the
same with LoRA r=8; `wide-pretrained-lora`: a one-block, 1536-wide pretrained Llama in bf16 with LoRA r=8, one
sequence a step, whose peak is while a unit's weights load: Note [peak memory]'s init term), `infinity train`
runs `--steps` steps in a fresh process, `--repeats` times, alternating sources (`--sources a,b`: only those);
each run's summary.json holds its predicted and measured peak RSS, steady step (median of steps 2 on) and step 1.
Reported per source: the measured / predicted ratios of each run and their medians.

    python benchmarks/bench_estimate.py --accuracy --steps 12 --repeats 3 --json accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bpe_tokenizer, machine, median, write_json  # noqa: E402

LLAMA_2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
               "intermediate_size": 28672, "num_attention_heads": 64, "num_hidden_layers": 80,
               "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
               "torch_dtype": "float16", "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 10000.0,
               "bos_token_id": 1, "eos_token_id": 2}
SHAPE = ["--model", "llama", "--set", "model.n_layer=80", "--set", "model.d_model=8192", "--set", "model.n_head=64",
         "--set", "model.n_kv_head=8", "--set", "model.ffn_dim=28672", "--set", "model.vocab_size=32000"]


def run(command: list[str], cwd: str | None) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode not in (0, 1) or "model: " not in out.stdout:
        raise SystemExit(f"{' '.join(command)} failed ({out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
            "exit": out.returncode}


COMMON = ["run.batch_size=4", "run.eval_every=0", "run.eval_batches=1", "model.seq_len=64"]
TINY_SHAPE = ["model.n_layer=2", "model.d_model=64", "model.n_head=4"]


def tiny_pretrained(root: str) -> tuple[str, str]:
    """A tiny Llama with its own BPE tokenizer, saved as a pretrained directory, and a text corpus."""
    import transformers
    text = "the stone is grey and the sky is blue; what is two plus two? four. " * 40
    fast = bpe_tokenizer([text])
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = os.path.join(root, "pretrained")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    fast.save_pretrained(path)
    corpus = os.path.join(root, "corpus.txt")
    with open(corpus, "w") as f:
        f.write(text * 20)
    return path, corpus


def wide_pretrained(root: str) -> str:
    """A one-block, 1536-wide Llama (38.5M parameters) in bf16, saved as a pretrained directory without a
    tokenizer (its runs read bytes as token ids)."""
    import torch
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=1536, intermediate_size=6144, num_hidden_layers=1,
                                   num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=128,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    path = os.path.join(root, "wide")
    transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return path


def accuracy(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path, corpus = tiny_pretrained(tmp)
        wide = wide_pretrained(tmp)
        only = set(args.sources.split(",")) if args.sources else None
        sources = {"gpt": TINY_SHAPE, "llama": TINY_SHAPE + ["model.kind=llama"],
                   "pretrained": [f"model.pretrained={path}", f"data.path={corpus}"],
                   "pretrained-lora": [f"model.pretrained={path}", f"data.path={corpus}", "model.lora.r=8"],
                   "wide-pretrained-lora": [f"model.pretrained={wide}", "model.tokenizer=bytes", "model.lora.r=8",
                                            "run.batch_size=1"]}
        sources = {k: v for k, v in sources.items() if only is None or k in only}
        runs: dict[str, list[dict]] = {}
        for i in range(args.repeats):
            for name, sets in sources.items():
                cmd = [sys.executable, "-m", "infinity", "train", "--quiet"]
                for s in COMMON + sets + [f"run.steps={args.steps}", f"run.dir={tmp}/runs", f"run.name={name}-{i}"]:
                    cmd += ["--set", s]
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
                with open(os.path.join(tmp, "runs", f"{name}-{i}", "summary.json")) as f:
                    p = json.load(f)["predicted"]
                r = {"ratio": p["ratio"], "measured": p["measured"], "predicted": {
                    k: p[k] for k in ("peak_rss_bytes", "step_seconds", "host_step_seconds", "first_step_seconds")}}
                runs.setdefault(name, []).append(r)
                print(f"{name:16s} measured/predicted: peak RSS {r['ratio']['peak_rss']:.2f}x, steady step "
                      f"{r['ratio']['steady_step']:.2f}x, step 1 {r['ratio']['first_step']:.2f}x", file=sys.stderr)
    summary = {name: {f"{k}_median": median([r["ratio"][k] for r in rs]) for k in ("peak_rss", "steady_step",
                                                                                  "first_step")}
               for name, rs in runs.items()}
    for name, s in summary.items():
        print(f"{name:16s} medians: peak RSS {s['peak_rss_median']:.2f}x, steady step {s['steady_step_median']:.2f}x, "
              f"step 1 {s['first_step_median']:.2f}x")
    write_json(args.json, {"benchmark": "estimate_accuracy", "machine": machine(), "load_average": os.getloadavg(),
                           "repeats": args.repeats, "steps": args.steps, "summary": summary, "runs": runs})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--accuracy", action="store_true", help="measure the predictions' error over the model sources")
    p.add_argument("--steps", type=int, default=12, help="with --accuracy: steps of each run")
    p.add_argument("--sources", default="", help="with --accuracy: only these sources (comma-separated)")
    p.add_argument("--before", metavar="DIR", help="a checkout of another commit, run interleaved")
    p.add_argument("--json", metavar="FILE", help="also write the result here")
    args = p.parse_args()
    if args.accuracy:
        return accuracy(args)
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(LLAMA_2_70B, f)
        configs = {"llama_shape": SHAPE, "pretrained_dir": ["--set", f"model.pretrained={tmp}",
                                                            "--set", "model.tokenizer=bytes"]}
        trees = {"now": (["infinity", "estimate"], None)}
        if args.before:
            trees["before"] = ([sys.executable, "-m", "infinity.job.cli", "estimate"], args.before)
        runs: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for tree, (prefix, cwd) in trees.items():
                for name, extra in configs.items():
                    r = run(prefix + extra, cwd)
                    runs.setdefault(f"{tree}/{name}", []).append(r)
                    print(f"{tree:6s} {name:14s} wall {r['wall_s']:.2f} s, cpu {r['cpu_s']:.2f} s", file=sys.stderr)
    summary = {key: {"wall_median_s": median([r["wall_s"] for r in rs]),
                     "wall_range_s": [min(r["wall_s"] for r in rs), max(r["wall_s"] for r in rs)],
                     "cpu_median_s": median([r["cpu_s"] for r in rs])} for key, rs in runs.items()}
    for key, s in summary.items():
        print(f"{key:22s} wall median {s['wall_median_s']:.2f} s ({s['wall_range_s'][0]:.2f}-"
              f"{s['wall_range_s'][1]:.2f}), cpu median {s['cpu_median_s']:.2f} s")
    load = os.getloadavg()
    write_json(args.json, {"benchmark": "estimate_70b", "machine": machine(), "load_average": load,
                           "repeats": args.repeats, "bar_s": 5.0, "summary": summary, "runs": runs})


if __name__ == "__main__":
    main()
