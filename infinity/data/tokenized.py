"""The job's data as token ids for one rank: the corpus as bytes or as the pretrained model's tokenizer gives
them (data.format = "text"), or completion / chat samples (samples.py) rendered by that tokenizer.

Note [tokenized data cache]: tokenizing is done once per data file and tokenizer, not once per start. The token
ids (text) or the samples' ids and labels (completion / chat) are saved as a safetensors file beside the data,
in `.infinity-tokens/<file name>.<key>.safetensors` (in the user's cache directory when the data's directory
cannot be written), and read back on the next start. The key is the SHA-256 of the data file's bytes, of the
tokenizer's files (TOKENIZER_IDENTITY_FILES), of the settings that shape the samples (data.format, its field
names, train_on_prompt, truncation, model.seq_len) and of the transformers version: a changed file, tokenizer
or setting tokenizes again, under a new key. Only tensors are read back (safetensors: no code runs).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Protocol

import torch

from infinity.config.job import DataConfig, ModelConfig, RunConfig
from infinity.config.options import ConfigError
from infinity.config.sections import Config
from infinity.models.build import TOKENIZER_IDENTITY_FILES, need_transformers, tokenizer_dir

CACHE_DIR = ".infinity-tokens"  # beside the data file (Note [tokenized data cache])
CACHE_FORMAT = 1


class Job(Protocol):
    """What the data of a job is read from: the job's sections (infinity.job.spec.Job is one) and its engine
    config (the attention mask's dtype is the compute dtype's)."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig
    given: frozenset  # the job keys the user set (an explicit data.format is obeyed)

    def engine_config(self, run_dir: str, start: int = 0) -> Config: ...


@functools.lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path | str) -> str:
    """SHA-256 of a file's bytes, read once per process while its size and mtime stay the same (the cache key of
    tokenized data, and what a checkpoint records of the data files: Note [changed data file])."""
    st = os.stat(path)
    return _file_sha256(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def cache_key(data_file: Path, tokenizer_where: str, settings: dict) -> str:
    """The key of a data file's token ids (Note [tokenized data cache])."""
    import transformers
    files = {name: file_sha256(Path(tokenizer_where, name)) for name in TOKENIZER_IDENTITY_FILES
             if os.path.isfile(os.path.join(tokenizer_where, name))}
    payload = {"format": CACHE_FORMAT, "data": file_sha256(data_file), "tokenizer": files, "settings": settings,
               "transformers": transformers.__version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _cache_files(data_file: Path, key: str) -> list[Path]:
    """Where the cache of `data_file` under `key` is looked for: beside the data, then the user's cache."""
    from infinity.machine.link_rates import cache_path
    name = f"{data_file.name}.{key}.safetensors"
    return [data_file.parent / CACHE_DIR / name, cache_path().parent / "tokens" / name]


def cached(data_file: Path, tokenizer_where: str, settings: dict,
           make: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The tensors `make()` gives for this data file, tokenizer and settings: read from the cache when it holds
    them, else made and saved there (Note [tokenized data cache])."""
    from safetensors import SafetensorError
    from safetensors.torch import load, save

    from io_engine import atomic_write
    key = cache_key(data_file, tokenizer_where, settings)
    places = _cache_files(data_file, key)
    for place in places:
        if place.is_file():
            try:
                return load(place.read_bytes())
            except (SafetensorError, OSError, ValueError):
                break  # damaged (a disk error, a partial copy): made again and replaced below
    tensors = make()
    payload = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"key": key})
    errors = []
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(place, payload)
            return tensors
        except OSError as e:
            errors.append(f"{place.parent}: {e.strerror}")
    import sys
    print(f"note: the token ids of {data_file} are not cached ({'; '.join(errors)}): the next start tokenizes "
          f"again", file=sys.stderr, flush=True)
    return tensors


def corpus_tokens(job: Job) -> torch.Tensor:
    """The job's corpus as token ids: bytes (uint8), or int32 ids of the pretrained model's tokenizer."""
    from infinity.data.batches import corpus_path, load_tokens
    raw = load_tokens(job.data.path)
    where = tokenizer_dir(job.model)
    if where is None:
        return raw
    transformers = need_transformers(f"model.pretrained = {where!r}", 'or --set model.tokenizer=bytes')

    def tokenize() -> dict[str, torch.Tensor]:
        tokenizer = _tokenizer(job, where)
        lines = bytes(raw.numpy()).decode("utf-8", errors="replace").splitlines(keepends=True)
        ids: list[int] = []
        for i in range(0, len(lines), 4096):  # batches of lines: a fast tokenizer encodes them in parallel
            chunk = tokenizer(lines[i:i + 4096], add_special_tokens=False, verbose=False)["input_ids"]
            for row in chunk:
                ids.extend(row)
        return {"ids": torch.tensor(ids, dtype=torch.int32)}
    tokens = cached(corpus_path(job.data.path), where, {"format": "text"}, tokenize)["ids"]
    vocab = transformers.AutoConfig.from_pretrained(where, local_files_only=True).vocab_size
    if len(tokens) and int(tokens.max()) >= vocab:
        raise ConfigError(f"model.pretrained = {where!r}: its tokenizer gives token id {int(tokens.max())}, beyond "
                          f"the model's vocabulary of {vocab}: save the model's own tokenizer there, or --set "
                          f"model.tokenizer=bytes")
    return tokens


def _tokenizer(job: Job, where: str):
    transformers = need_transformers(f"model.pretrained = {where!r}", 'or --set model.tokenizer=bytes')
    try:
        return transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model.pretrained = {where!r}: its tokenizer does not load ({e}); fix its files, or "
                          f"--set model.tokenizer=bytes to train on bytes as token ids") from None


def sample_batches(job: Job, rank: int = 0, world: int = 1):
    """Batches of completion / chat records (samples.py, Note [masked fine-tuning loss])."""
    from infinity.data.samples import SampleBatches, split_samples
    where = tokenizer_dir(job.model)
    if where is None:
        raise ConfigError(f"data.format = {job.data.format!r} needs a tokenizer: set model.pretrained to a model "
                          f"directory with its tokenizer saved in it (and model.tokenizer = \"auto\"), or use "
                          f'data.format = "text"')
    tokenizer = _tokenizer(job, where)
    samples = _cached_samples(job, tokenizer, where, job.data.path)
    if job.data.val_path:
        train, val = samples, _cached_samples(job, tokenizer, where, job.data.val_path, "data.val_path")
    else:
        train, val = split_samples(samples, job.data.val_fraction, job.data.path)
    compute = job.engine_config(".").precision.compute_dtype
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(compute, torch.float32)  # the attention mask's
    return SampleBatches(train, val, seq_len=job.model.seq_len, global_batch=job.run.batch_size,
                         seed=job.data.seed, packing=job.data.packing, dtype=dtype, rank=rank, world=world)


def resolve_data_format(job: Job) -> tuple[Job, str | None]:
    """The job with data.format as data.path's records say, and the line saying a change (Note [data format from
    the records] in samples.py); a mismatch it cannot resolve is a ConfigError naming data.format."""
    import dataclasses

    from infinity.data.samples import resolve_format
    fmt, said = resolve_format(job.data, explicit="data.format" in job.given)
    changed = fmt != job.data.format
    if changed:
        job = dataclasses.replace(job, data=dataclasses.replace(job.data, format=fmt))
    job.data.check_format_keys()  # only now is the format known
    return job, said if changed else None


def _cached_samples(job: Job, tokenizer, where: str, path: str, key: str = "data.path") -> list:
    """load_samples of `path`, through the cache (Note [tokenized data cache]): ids and labels of all samples
    end to end, and each sample's length."""
    from infinity.data.samples import Sample, load_samples
    d = job.data
    settings = {"format": d.format, "prompt_field": d.prompt_field, "completion_field": d.completion_field,
                "messages_field": d.messages_field, "train_on_prompt": d.train_on_prompt,
                "truncation": d.truncation, "seq_len": job.model.seq_len}

    def tokenize() -> dict[str, torch.Tensor]:
        samples = load_samples(d, tokenizer, where, job.model.seq_len, path, key)
        return {"ids": torch.tensor([t for s in samples for t in s.ids], dtype=torch.int32),
                "labels": torch.tensor([t for s in samples for t in s.labels], dtype=torch.int32),
                "lengths": torch.tensor([len(s.ids) for s in samples], dtype=torch.int64)}
    file = Path(path)
    if not file.is_file():
        return load_samples(d, tokenizer, where, job.model.seq_len, path, key)  # its error names the path
    saved = cached(file, where, settings, tokenize)
    ids, labels = saved["ids"].tolist(), saved["labels"].tolist()
    out, at = [], 0
    for n in saved["lengths"].tolist():
        out.append(Sample(ids[at:at + n], labels[at:at + n]))
        at += n
    return out


def job_batches(job: Job, rank: int = 0, world: int = 1):
    """The job's training and validation batches for one rank (data.py's sampler over `corpus_tokens`, or
    samples.py's over completion / chat records; data.format resolved by `resolve_data_format`, whose line the
    job prints)."""
    from infinity.data.batches import Batches, split
    job, _ = resolve_data_format(job)
    if job.data.format != "text":
        return sample_batches(job, rank, world)
    train, val = split(corpus_tokens(job), job.data.val_fraction, job.model.seq_len)
    return Batches(train, val, seq_len=job.model.seq_len, global_batch=job.run.batch_size, seed=job.data.seed,
                   rank=rank, world=world)
