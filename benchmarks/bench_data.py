"""The job's data as token shards (issue 59): the tokenizing rate against the tokenizer's own batch rate on the same
cores, the second start's cache read, and the job's peak RSS against the corpus size. Generated corpora only.

    flock /work/bench.lock python benchmarks/bench_data.py --dir /work/tmp-data --json data.json
    python benchmarks/bench_data.py --dir DIR --tokenize-mib 50 --sizes-mib 200,2048 --repeats 2 --json out.json

1. Tokenizing (`--tokenize-mib`, default 50): a generated text of lines of 4-20 words drawn from a fixed list of
   2000 generated words, and a "pretrained" directory (a tiny Llama, random weights) saved with a byte-level BPE
   of vocabulary 4096 trained here on the first MiB of the text. In the same process, alternating, `--repeats`
   times: (a) the tokenizer's own batch API, `tokenizer(lines[i:i + 4096], add_special_tokens=False)` over the
   whole text already in memory (the ids only counted), and (b) the job's path, `corpus_tokens` (Note [parallel
   tokenizing]) with the cache removed first: read, check, tokenize, write the shard. Reported: MiB/s of each and
   (b) / (a). Then (c) the second start: `corpus_tokens` of the same job in a fresh process, timed around the
   call (the data file's hash, the shard's maps). And (d) the job's peak RSS (`infinity train`, 3 steps, the
   tiny Llama, a fresh process each, the cache warm) on the 50 MiB text against the same job on a 1 MiB one.
2. Peak RSS against the corpus size (`--sizes-mib`, default 200,2048): byte tokens (no tokenizer), `infinity
   train --set data.path=CORPUS --set run.steps=5` in a fresh process per size; its summary.json's peak RSS and
   the estimate's prediction.

3. Files (`--files-mib`, default 20,200): the same byte-token job on a parquet file of documents (a "text" column
   of ~4 KiB texts cut from a generated corpus, row groups of 1024; Note [text records]: streamed through
   datasets) and on a directory of 10 text files (Note [data of several files]), each at every size: its peak RSS
   (the first start, which writes the parquet's byte shard, is not the run's: the shard is made first by
   `infinity data prepare` in its own process, whose peak RSS is reported too).

`--parts` picks the parts (default tokenize,sizes,files). The corpora are written under --dir and removed at the
end (--keep keeps them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import bpe_tokenizer, machine, median, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def words(seed: int = 0, n: int = 2000) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 10))) for _ in range(n)]


def write_corpus(path: str, mib: int, seed: int = 0) -> str:
    """A text of `mib` MiB: 64 different 1 MiB blocks of generated lines, repeated in a seeded order."""
    if os.path.exists(path) and os.path.getsize(path) >= mib << 20:
        return path
    rng, vocab = random.Random(seed), words(seed)
    blocks = []
    for _ in range(min(64, mib)):
        lines, size = [], 0
        while size < 1 << 20:
            line = " ".join(rng.choice(vocab) for _ in range(rng.randint(4, 20))) + "\n"
            lines.append(line)
            size += len(line)
        blocks.append("".join(lines).encode())
    with open(path, "wb") as f:
        written = 0
        while written < mib << 20:
            block = blocks[rng.randrange(len(blocks))]
            f.write(block)
            written += len(block)
    return path


def make_pretrained(path: str, text_file: str, vocab: int = 4096) -> str:
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers
    with open(text_file, "rb") as f:
        sample = f.read(1 << 20).decode()
    tokenizer = bpe_tokenizer(sample.splitlines(), vocab)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def batch_api_seconds(pretrained: str, text_file: str) -> tuple[float, int]:
    """(seconds, tokens) of the tokenizer's own batch API over the text already in memory."""
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(pretrained)
    with open(text_file, "rb") as f:
        lines = f.read().decode().splitlines(keepends=True)
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(lines), 4096):
        tokens += sum(map(len, tokenizer(lines[i:i + 4096], add_special_tokens=False, verbose=False)["input_ids"]))
    return time.perf_counter() - start, tokens


def job_seconds(pretrained: str, text_file: str) -> tuple[float, int]:
    """(seconds, tokens) of the job's tokenizing (`corpus_tokens`), the cache removed first."""
    from infinity.data.tokenized import corpus_tokens
    from infinity.job.spec import load_job
    shutil.rmtree(os.path.join(os.path.dirname(text_file), ".infinity-tokens"), ignore_errors=True)
    job = load_job(None, [f"model.pretrained={pretrained}", f"data.path={text_file}"])
    start = time.perf_counter()
    ids = corpus_tokens(job)
    return time.perf_counter() - start, len(ids)


SECOND_START = """
import sys, time
import transformers  # (imported by the job for the model in any case: not the data's time)
from infinity.data.tokenized import corpus_tokens
from infinity.job.spec import load_job
job = load_job(None, ["model.pretrained=" + sys.argv[1], "data.path=" + sys.argv[2]])
start = time.perf_counter()
ids = corpus_tokens(job)
print(time.perf_counter() - start, len(ids))
"""


def env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def second_start(pretrained: str, text_file: str) -> float:
    out = subprocess.run([sys.executable, "-c", SECOND_START, pretrained, text_file], capture_output=True,
                         text=True, env=env(), check=True)
    return float(out.stdout.split()[0])


def train_peak(root: str, name: str, sets: list[str], steps: int) -> dict:
    """peak RSS (MiB) of `infinity train` in a fresh process, and the estimate's."""
    cmd = [sys.executable, "-m", "infinity", "train", "--quiet"]
    export = ["run.export=false"] if any(s.startswith("model.pretrained=") for s in sets) else []
    for s in sets + export + [f"run.steps={steps}", "run.eval_every=0", "run.eval_batches=1", "run.checkpoint=false",
                              f"run.dir={root}/runs", f"run.name={name}"]:
        cmd += ["--set", s]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env())
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(root, "runs", name, "summary.json")) as f:
        summary = json.load(f)
    shutil.rmtree(os.path.join(root, "runs", name), ignore_errors=True)
    predicted = (summary.get("predicted") or {}).get("peak_rss_bytes")
    return {"peak_rss_MiB": round(summary["peak_rss_bytes"] / 2**20, 1),
            "predicted_MiB": round(predicted / 2**20, 1) if predicted else None,
            "wall_s": round(time.perf_counter() - start, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", required=True, help="where the generated corpora and runs go (removed at the end)")
    ap.add_argument("--tokenize-mib", type=int, default=50)
    ap.add_argument("--small-mib", type=int, default=1, help="the small corpus the tokenized job's RSS is held to")
    ap.add_argument("--sizes-mib", default="200,2048", help="byte-token corpora for peak RSS vs size ('' = none)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--files-mib", default="20,200", help="parquet / directory corpora for peak RSS ('' = none)")
    ap.add_argument("--parts", default="tokenize,sizes,files", help="the parts to run, comma-separated")
    ap.add_argument("--keep", action="store_true", help="keep the generated corpora")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    work = os.path.join(args.dir, "bench-data")
    os.makedirs(work, exist_ok=True)
    result: dict = {"machine": machine(), "args": vars(args)}
    parts = set(args.parts.split(","))
    try:
        if "files" in parts:
            result["files_rss"] = files_rss(work, [int(m) for m in args.files_mib.split(",") if m], args.steps,
                                            args.keep)
        if "tokenize" in parts or "sizes" in parts:
            tokenize_and_sizes(work, args, parts, result)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    write_json(args.json, result)


def prepare_peak(path: str) -> float:
    """Peak RSS (MiB) of `infinity data prepare PATH` (byte tokens) in a fresh process."""
    code = ("import resource, sys\nfrom infinity.job.cli import main\nrc = main(['data', 'prepare', sys.argv[1]])\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\nsys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, env=env())
    if out.returncode != 0:
        raise SystemExit(f"infinity data prepare {path} failed:\n{out.stderr[-3000:]}")
    return round(float(out.stdout.split()[-1]), 1)


def files_rss(work: str, sizes: list[int], steps: int, keep: bool) -> dict:
    """Part 3: peak RSS of byte-token jobs on a parquet file of documents and on a directory of 10 text files."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = {}
    for size in sizes:
        text = write_corpus(os.path.join(work, f"docs{size}.txt"), size, seed=3)
        parquet = os.path.join(work, f"docs{size}.parquet")
        with open(text, "rb") as f, pq.ParquetWriter(parquet, pa.schema([("text", pa.string())])) as w:
            while block := f.read(4096 * 1024):
                w.write_table(pa.table({"text": [block[i:i + 4096].decode("utf-8", "replace")
                                                 for i in range(0, len(block), 4096)]}), row_group_size=1024)
        directory = os.path.join(work, f"dir{size}")
        os.makedirs(directory, exist_ok=True)
        with open(text, "rb") as f:
            piece = -(-os.path.getsize(text) // 10)
            for k in range(10):
                with open(os.path.join(directory, f"part-{k:02d}.txt"), "wb") as g:
                    g.write(f.read(piece))
        os.remove(text)
        out[f"parquet_{size}MiB"] = {"prepare_peak_rss_MiB": prepare_peak(parquet),
                                     **train_peak(work, f"parquet{size}", [f"data.path={parquet}"], steps)}
        out[f"dir_{size}MiB"] = train_peak(work, f"dir{size}", [f"data.path={directory}"], steps)
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
            shutil.rmtree(os.path.join(work, ".infinity-tokens"), ignore_errors=True)
            os.remove(parquet)
    return out


def tokenize_and_sizes(work: str, args, parts: set, result: dict) -> None:
    """Parts 1 and 2."""
    if "tokenize" in parts:
        text = write_corpus(os.path.join(work, f"text{args.tokenize_mib}.txt"), args.tokenize_mib)
        os.makedirs(os.path.join(work, "small"), exist_ok=True)
        small = write_corpus(os.path.join(work, "small", f"text{args.small_mib}.txt"), args.small_mib, seed=1)
        pretrained = make_pretrained(os.path.join(work, "pretrained"), text)
        mib = os.path.getsize(text) / 2**20
        api, job = [], []
        for _ in range(args.repeats):
            s, api_tokens = batch_api_seconds(pretrained, text)
            api.append(mib / s)
            s, job_tokens = job_seconds(pretrained, text)
            job.append(mib / s)
            assert api_tokens == job_tokens, (api_tokens, job_tokens)
        result["tokenize"] = {"MiB": round(mib, 1), "tokens": job_tokens,
                              "batch_api_MiB_s": [round(r, 3) for r in api], "job_MiB_s": [round(r, 3) for r in job],
                              "ratio_job_to_batch_api": round(median(job) / median(api), 3),
                              "second_start_s": [round(second_start(pretrained, text), 3)
                                                 for _ in range(args.repeats)]}
        second_start(pretrained, small)  # (its cache made: the RSS runs below start warm)
        tok_sets = [f"model.pretrained={pretrained}", "model.seq_len=128", "run.batch_size=8"]
        result["tokenized_job_rss"] = {
            f"{args.small_mib}MiB": train_peak(work, "small", tok_sets + [f"data.path={small}"], 3),
            f"{args.tokenize_mib}MiB": train_peak(work, "big", tok_sets + [f"data.path={text}"], 3)}
    sizes = [int(s) for s in args.sizes_mib.split(",") if s] if "sizes" in parts else []
    if sizes:
        result["bytes_rss_vs_size"] = {}
        for size in sizes:
            corpus = write_corpus(os.path.join(work, f"bytes{size}.txt"), size, seed=2)
            result["bytes_rss_vs_size"][f"{size}MiB"] = train_peak(work, f"bytes{size}",
                                                                   [f"data.path={corpus}"], args.steps)
            if not args.keep:
                os.remove(corpus)


if __name__ == "__main__":
    main()
