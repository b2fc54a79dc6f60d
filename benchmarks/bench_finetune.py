"""Fine-tuning a pretrained model through infinity: streamed load, LoRA, export, beside transformers.

    python benchmarks/bench_finetune.py --dir /path/on/nvme --json finetune.json      # 1.54B: TinyLlama, 32 layers
    python benchmarks/bench_finetune.py --hidden 256 --layers 2 --intermediate 512 --vocab 1000 --heads 8 \\
        --kv-heads 2 --shard-size 2MB --json small.json                                 # a quick check

Saves a Llama-shaped model once as sharded fp32 safetensors in --dir (random weights, written tensor
by tensor: the model is never whole in memory), then runs each case in its own process, with that
process's peak RSS (VmHWM, via benchmarks/common.peak_rss_bytes):

  a. `infinity.initialize(model, config, weights=DIR)` of the meta-built model, params, grads and
     optimizer on NVMe: load time, peak RSS, the first logits on a fixed prompt; beside
     transformers' `from_pretrained` of the same files (time, RSS, its logits: max abs diff);
  b. LoRA (r=16 on q, k, v, o) through PEFT, 5 steps: memory_report's optimizer bytes (master and
     moments, all tiers) beside 12 x trainable parameters;
  c. the export of the merged result as an HF directory (`export_state_dict(DIR, merge_lora=True)`)
     beside transformers' `save_pretrained` of the model it loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

PROMPT_SEED = 1234


def llama_config(args):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)


def prompt(vocab: int, seq: int):
    import torch
    return torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(PROMPT_SEED))


def save_model(args, out: str) -> dict:
    """The 'pretrained' checkpoint: fp32 shards of at most --shard-size, filled tensor by tensor."""
    import torch
    import transformers

    import infinity
    from infinity.state.export import write_safetensors_file
    from io_engine import parse_size
    cfg = llama_config(args)
    with infinity.meta_init():
        model = transformers.LlamaForCausalLM(cfg)
    specs = [(k, tuple(v.shape), torch.float32) for k, v in model.state_dict().items()]
    limit = parse_size(args.shard_size, "--shard-size")
    groups, size = [[]], 0
    for spec in specs:
        nbytes = 4 * torch.Size(spec[1]).numel()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def values(group):
        for key, shape, _ in group:
            if key.endswith("norm.weight"):
                yield 1 + 0.1 * torch.randn(shape, generator=gen)
            else:
                yield 0.02 * torch.randn(shape, generator=gen)

    t = time.perf_counter()
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        total += write_safetensors_file(os.path.join(out, name), group, values(group), {"format": "pt"})
        weight_map.update({g[0]: name for g in group})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    cfg.save_pretrained(out)
    params = sum(torch.Size(s[1]).numel() for s in specs)
    return {"params": params, "bytes": total, "shards": len(groups), "save_s": round(time.perf_counter() - t, 1)}


def nvme_config(swap: str, read_ahead="auto") -> dict:
    """All state on NVMe. The load case turns the optimizer's state read-ahead off: "auto" sizes its host
    buffers to the host budget (1.3 GB at 110M parameters here), which is training's working memory, not
    the load's."""
    return {"placement": {"params": "nvme", "grads": "nvme", "optimizer": "nvme"}, "nvme": {"paths": [swap]},
            "precision": {"compute_dtype": "fp32"}, "optimizer": {"lr": 1e-4, "weight_decay": 0.0},
            "overlap": {"optimizer_read_ahead": read_ahead}}


def case_infinity_load(model_dir: str, swap: str, logits_out: str, seq: int) -> dict:
    import torch
    import transformers
    from common import peak_rss_bytes

    import infinity
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with infinity.meta_init():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    t = time.perf_counter()
    with infinity.initialize(model, nvme_config(swap, read_ahead=0), weights=model_dir) as engine:
        load_s = time.perf_counter() - t
        load_rss = peak_rss_bytes()
        engine.eval()
        with torch.no_grad():
            logits = engine(input_ids=prompt(cfg.vocab_size, seq)).logits.float()
        torch.save(logits, logits_out)
    return {"load_s": round(load_s, 2), "peak_rss_after_load_GiB": round(load_rss / 2**30, 3),
            "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3)}


def case_transformers(model_dir: str, logits_out: str, save_dir: str, seq: int) -> dict:
    import torch
    import transformers
    from common import peak_rss_bytes
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t
    with torch.no_grad():
        logits = model(input_ids=prompt(model.config.vocab_size, seq)).logits.float()
    torch.save(logits, logits_out)
    t = time.perf_counter()
    model.save_pretrained(save_dir)
    save_s = time.perf_counter() - t
    return {"from_pretrained_s": round(load_s, 2), "save_pretrained_s": round(save_s, 2),
            "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3)}


def case_lora(model_dir: str, swap: str, export_dir: str, seq: int, steps: int) -> dict:
    import peft
    import torch
    import transformers
    from common import peak_rss_bytes

    import infinity
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    with infinity.meta_init():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    x = torch.randint(0, cfg.vocab_size, (1, seq + 1), generator=torch.Generator().manual_seed(7))
    with infinity.initialize(model, nvme_config(swap), weights=model_dir) as engine:
        step_s, losses = [], []
        for _ in range(steps):
            t = time.perf_counter()
            loss = engine(input_ids=x[:, :-1], labels=x[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            engine.synchronize()
            step_s.append(round(time.perf_counter() - t, 2))
            losses.append(round(loss.item(), 4))
        report = engine.memory_report()
        train_rss = peak_rss_bytes()
        state = report["state"]
        optimizer_bytes = sum(state[tier][kind] for tier in state for kind in ("master", "exp_avg", "exp_avg_sq"))
        t = time.perf_counter()
        engine.export_state_dict(export_dir, merge_lora=True)
        export_s = time.perf_counter() - t
    return {"trainable_params": trainable, "optimizer_bytes": optimizer_bytes,
            "twelve_x_trainable_bytes": 12 * trainable, "optimizer_over_12x_trainable": round(
                optimizer_bytes / (12 * trainable), 2), "step_s": step_s, "losses": losses,
            "export_merged_s": round(export_s, 2), "peak_rss_after_training_GiB": round(train_rss / 2**30, 3),
            "peak_rss_GiB": round(peak_rss_bytes() / 2**30, 3),
            "memory_report": {k: v for k, v in report.items() if isinstance(v, int)}}


CASES = {"infinity_load": case_infinity_load, "transformers": case_transformers, "lora": case_lora}


def child(case: str, *args) -> dict:
    """One case in its own process (its peak RSS is its own); the result is the last RESULT line."""
    proc = subprocess.run([sys.executable, __file__, "--case", case, json.dumps(args)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": proc.stderr[-3000:]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the checkpoint, swap and exports go (an NVMe disk)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)  # 1.54B parameters (TinyLlama's 22 layers: 1.10B)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--shard-size", default="2GB", help="the saved checkpoint's max shard size")
    ap.add_argument("--seq", type=int, default=32, help="prompt / training sequence length")
    ap.add_argument("--steps", type=int, default=5, help="LoRA training steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--case", default=None, help=argparse.SUPPRESS)
    ap.add_argument("args", nargs="?", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(CASES[args.case](*json.loads(args.args))))
        return
    import torch
    from common import machine, write_json
    root = tempfile.mkdtemp(prefix="bench-finetune-", dir=args.dir)
    try:
        model_dir = os.path.join(root, "pretrained")
        result = {"benchmark": "finetune", "machine": machine(),
                  "shape": {k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "vocab", "heads",
                                                          "kv_heads", "seq")},
                  "saved": save_model(args, model_dir)}
        ours, theirs = os.path.join(root, "ours.pt"), os.path.join(root, "theirs.pt")
        swap = os.path.join(root, "swap")
        os.makedirs(swap)
        result["infinity_load"] = child("infinity_load", model_dir, swap, ours, args.seq)
        shutil.rmtree(swap, ignore_errors=True)
        result["transformers"] = child("transformers", model_dir, theirs, os.path.join(root, "saved_hf"), args.seq)
        shutil.rmtree(os.path.join(root, "saved_hf"), ignore_errors=True)
        if os.path.exists(ours) and os.path.exists(theirs):
            a, b = torch.load(ours), torch.load(theirs)
            result["logits_max_abs_diff"] = (a - b).abs().max().item()
            result["logits_max_abs"] = b.abs().max().item()
        os.makedirs(swap)
        result["lora"] = child("lora", model_dir, swap, os.path.join(root, "merged"), args.seq, args.steps)
        load, hf = result["infinity_load"], result["transformers"]
        result["summary"] = {
            "load_s": load.get("load_s"), "from_pretrained_s": hf.get("from_pretrained_s"),
            "load_peak_rss_GiB": load.get("peak_rss_after_load_GiB"), "bar_peak_rss_GiB": 1.5,
            "logits_max_abs_diff": result.get("logits_max_abs_diff"),
            "export_merged_s": result["lora"].get("export_merged_s"), "save_pretrained_s": hf.get("save_pretrained_s"),
            "lora_optimizer_bytes": result["lora"].get("optimizer_bytes"),
            "lora_12x_trainable_bytes": result["lora"].get("twelve_x_trainable_bytes")}
        write_json(args.json, result)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
