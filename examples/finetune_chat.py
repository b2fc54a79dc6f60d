"""Chat fine-tune with `infinity train`: a tiny "pretrained" Llama with a chat template learns to answer in the
data's format (docs/finetune-data.md).

    pip install "infinity[hf]"
    python examples/finetune_chat.py                 # ~1 minute on a laptop CPU, no download

1. The "pretrained" model: a tiny Llama with random weights and a byte-level BPE tokenizer trained here on the
   data file's text, with a chat template (<|user|>...</s><|assistant|>...</s>) and EOS </s>, saved by
   save_pretrained.
2. `infinity train --set data.format=chat --set data.path=examples/data/chat_sums.jsonl --set data.packing=true`:
   each line's messages are rendered by the tokenizer's chat template; only the assistant turns are scored
   (labels -100 elsewhere); several conversations share a row without seeing each other.
3. The export answers new questions through transformers' generate: a number, a full stop and </s>, the
   format of the assistant turns, not the JSON of the file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "chat_sums.jsonl")
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_pretrained(path: str) -> None:
    texts = [m["content"] for line in open(DATA) for m in json.loads(line)["messages"]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["</s>", "<|system|>", "<|user|>", "<|assistant|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="</s>")
    tokenizer.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id,
                                   bos_token_id=None, pad_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)


def answer(model_dir: str, tokenizer_dir: str, question: str) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--out", default=None, help="run directory (default: a temporary one)")
    args = ap.parse_args()
    work = args.out or tempfile.mkdtemp(prefix="infinity-chat-")
    pretrained = os.path.join(work, "pretrained")
    make_pretrained(pretrained)
    questions = ["3 plus 4?", "9 plus 9?", "0 plus 6?"]
    print("before:", [answer(pretrained, pretrained, q) for q in questions])
    subprocess.run([sys.executable, "-m", "infinity", "train", "--set", f"model.pretrained={pretrained}",
                    "--set", f"data.path={DATA}", "--set", "data.format=chat", "--set", "data.packing=true",
                    "--set", "model.seq_len=64", "--set", "run.batch_size=8", "--set", f"run.steps={args.steps}",
                    "--set", "optimizer.lr=1e-2", "--set", "optimizer.warmup_steps=10", "--set", "run.eval_every=50",
                    "--set", f"run.dir={work}", "--set", "run.name=chat"], check=True)
    export = os.path.join(work, "chat", "export")
    answers = [answer(export, pretrained, q) for q in questions]
    print("after: ", answers)
    if not all(re.fullmatch(r"\d+\.</s>", a) for a in answers):  # a number, a full stop and </s>
        sys.exit(f"after {args.steps} steps the model does not answer in the format yet (a number, a full stop, "
                 f"</s>): train longer, e.g. --steps 150 (the default)")
    print(f"the fine-tuned model answers in the chat format and stops; export in {export}")


if __name__ == "__main__":
    main()
