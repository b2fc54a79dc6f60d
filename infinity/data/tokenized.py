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

import os
from pathlib import Path
from typing import Protocol

import torch

from infinity.config.job import DataConfig, ModelConfig, RunConfig
from infinity.config.options import ConfigError
from infinity.config.sections import Config
from infinity.data.shards import CACHE_DIR, cache_key, cached, file_sha256  # noqa: F401 - (the cache's names here too)
from infinity.models.build import need_transformers, tokenizer_dir


class Job(Protocol):
    """What the data of a job is read from: the job's sections (infinity.job.spec.Job is one) and its engine
    config (the attention mask's dtype is the compute dtype's)."""

    model: ModelConfig
    data: DataConfig
    run: RunConfig
    given: frozenset  # the job keys the user set (an explicit data.format is obeyed)

    def engine_config(self, run_dir: str, start: int = 0) -> Config: ...


def _pool_settings(tokenizer, where: str, extra: dict | None = None) -> dict:
    from infinity.data.shards import smallest_dtype
    return {"dtype": smallest_dtype(max(len(tokenizer), tokenizer.vocab_size or 0)), **(extra or {})}


def corpus_tokens(job: Job, workers: int | None = None):
    """The job's corpus as token ids, memory-mapped (Note [token shards]): bytes (uint8), or the pretrained
    model's tokenizer's ids in the smallest dtype that holds them, tokenized once in parallel (Note [parallel
    tokenizing]); several files' ids end to end (a sources.TokenStream, Note [data of several files])."""
    import collections

    from infinity.data.batches import byte_tokens, input_chunks
    from infinity.data.pool import encode_text, ordered_map, workers_for
    from infinity.data.shards import TokenizeProgress
    from infinity.data.sources import TokenStream, cut, resolve
    where = tokenizer_dir(job.model)
    if where is None:
        return byte_tokens(job.data.path, job.data.text_field)
    transformers = need_transformers(f"model.pretrained = {where!r}", 'or --set model.tokenizer=bytes')
    found = resolve(job.data.path)
    tokenizer = None

    def dtype():
        nonlocal tokenizer
        tokenizer = _tokenizer(job, where)
        return _pool_settings(tokenizer, where)["dtype"]

    def build(writer) -> dict:
        size = sum(os.path.getsize(f) for f in found.files)
        gz = any(f.suffix == ".gz" for f in found.files)
        progress = TokenizeProgress(found.anchor.name, 0 if gz or found.records else size)
        sizes: collections.deque = collections.deque()  # (file index, bytes) of each chunk in flight
        counts = [0] * len(found.files)

        def chunks():
            for k, file in enumerate(found.files):
                for chunk in input_chunks(found, file, job.data.text_field):
                    sizes.append((k, len(chunk)))
                    yield chunk
        done = tokens = 0
        threaded = getattr(tokenizer, "is_fast", False)  # (its batch encode runs on every core)
        for ids in ordered_map(encode_text, chunks(), workers_for(size, workers, threaded=threaded), where, tokenizer,
                               _pool_settings(tokenizer, where)):
            writer.add(ids)
            k, n = sizes.popleft()
            counts[k] += len(ids)
            done, tokens = done + n, tokens + len(ids)
            progress.update(done, tokens)
        if tokens == 0:
            from infinity.data.batches import empty_corpus
            raise empty_corpus(found.say())
        progress.done(done, tokens, writer.final)
        return {"tokenizer": where, **({"parts": counts} if found.several else {})}
    settings = {"format": "text", **({"text_field": job.data.text_field} if found.records else {})}
    shard = cached(found.anchor, where, settings, build, records=False, dtype=dtype, files=found.named())
    vocab = _vocab_size(transformers, where)
    if shard.meta["max_id"] >= vocab:
        raise ConfigError(f"model.pretrained = {where!r}: its tokenizer gives token id {shard.meta['max_id']}, "
                          f"beyond the model's vocabulary of {vocab}: save the model's own tokenizer there, or "
                          f"--set model.tokenizer=bytes")
    return TokenStream(cut(shard.ids, shard.meta["parts"])) if found.several else shard.ids


def _vocab_size(transformers, where: str) -> int:
    """The model's vocabulary: config.json's vocab_size as the file says it (AutoConfig's import of the model's
    configuration module costs ~2 s of a start that reads its tokens from the cache), else AutoConfig's."""
    import json
    try:
        with open(os.path.join(where, "config.json")) as f:
            vocab = json.load(f).get("vocab_size")
        if isinstance(vocab, int):
            return vocab
    except (OSError, ValueError):
        pass
    return transformers.AutoConfig.from_pretrained(where, local_files_only=True).vocab_size


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


def _cached_samples(job: Job, tokenizer, where: str, path: str, key: str = "data.path",
                    workers: int | None = None):
    """The samples of the files `path` names (samples.render_sample of each record) through the cache (Note
    [tokenized data cache]): a shard of their ids, loss mask and boundaries (Note [token shards]), read as a
    samples.SampleShard, or, for several files, a sources.SampleChain of each file's range of it (Note [data of
    several files])."""
    import collections

    from infinity.data.pool import ordered_map, render_records, workers_for
    from infinity.data.samples import SampleShard, check_template, no_samples, record_files
    from infinity.data.shards import RECORDS_PER_CHUNK, TokenizeProgress
    from infinity.data.sources import SampleChain, cut, stream_records
    d = job.data
    settings = {"format": d.format, "prompt_field": d.prompt_field, "completion_field": d.completion_field,
                "messages_field": d.messages_field, "train_on_prompt": d.train_on_prompt,
                "truncation": d.truncation, "seq_len": job.model.seq_len}
    found = record_files(path, key)
    check_template(d, tokenizer, where)
    pool = _pool_settings(tokenizer, where, {"data": d, "seq_len": job.model.seq_len})

    def build(writer) -> dict:
        size = sum(f.stat().st_size for f in found.files)
        progress = TokenizeProgress(found.anchor.name, size)
        pending: collections.deque = collections.deque()  # (file index, records) of each chunk in flight
        counts = [0] * len(found.files)
        read = [0]  # bytes of the files read whole

        def chunks():
            for k, file in enumerate(found.files):
                chunk: list = []
                for item in stream_records(file, found.say(file)):
                    chunk.append(item)
                    if len(chunk) == RECORDS_PER_CHUNK:
                        pending.append((k, len(chunk)))
                        yield chunk
                        chunk = []
                if chunk:
                    pending.append((k, len(chunk)))
                    yield chunk
                read[0] += file.stat().st_size
        records = tokens = 0
        for ids, mask, lengths in ordered_map(render_records, chunks(), workers_for(size, workers), where,
                                              tokenizer, pool):
            writer.add(ids, mask, lengths)
            k, n = pending.popleft()
            counts[k] += len(lengths)
            records, tokens = records + n, tokens + len(ids)
            progress.update(read[0], tokens)
        if writer.samples == 0:
            raise no_samples(path)
        progress.done(size, tokens, writer.final)
        return {"tokenizer": where, "records": records, **({"parts": counts} if found.several else {})}
    shard = cached(found.anchor, where, settings, build, records=True, dtype=lambda: pool["dtype"],
                   files=found.named())
    samples = SampleShard(shard.ids, shard.mask, shard.offsets)
    return SampleChain(cut(samples, shard.meta["parts"])) if found.several else samples


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


def _kept(ids) -> str:
    """Where the job reads these ids from (the files themselves, or their shard's directory)."""
    parts = getattr(ids, "parts", [ids])
    places = {str(getattr(p, "filename", None) or "") for p in parts}
    if not any(place.endswith(".bin") for place in places):
        return "the files themselves (plain text is read in place)"
    return ", ".join(sorted({str(Path(place).parent) for place in places if place.endswith(".bin")}))


def prepare(job: Job, workers: int | None = None) -> list[str]:
    """`infinity data prepare`: the job's data tokenized into its shards now (as the run would: the same cache
    key, so the run reads them), with a line per setting saying what is there."""
    from infinity.data.sources import resolve
    job, said = resolve_data_format(job)
    lines = [said] if said else []
    where = tokenizer_dir(job.model)

    def files(path: str, key: str) -> str:
        count = len(resolve(path, key).files)
        return f" ({count} files)" if count > 1 else ""
    if job.data.format == "text":
        ids = corpus_tokens(job, workers)
        lines.append(f"{job.data.path}{files(job.data.path, 'data.path')}: {len(ids):,} "
                     f"{'byte' if where is None else 'token'} ids ({ids.dtype}); read from {_kept(ids)}")
        return lines
    tokenizer = _tokenizer(job, where) if where else None
    if tokenizer is None:
        sample_batches(job)  # its error names what is missing
    for path, key in ((job.data.path, "data.path"), (job.data.val_path, "data.val_path")):
        if path:
            samples = _cached_samples(job, tokenizer, where, path, key, workers)
            shard = getattr(samples, "parts", [samples])[0]
            lines.append(f"{path}{files(path, key)}: {len(samples):,} samples, {len(shard.ids):,} token ids "
                         f"({shard.ids.dtype}) with their loss mask; read from {Path(str(shard.ids.filename)).parent}")
    return lines


# Note [data in the estimate]: the data pipeline's resident bytes, two terms of the estimate's peak
# (Note [peak memory]): "data", while training: the windows in flight (Note [batches ahead]: DEPTH queued, one
# being built, one in use; each the global micro-batches as int64 inputs and targets, the rank's rows copied out
# of them, and on a CPU device the samples' 4D attention masks built ahead with their boolean intermediates) and
# the bytes read for one batch (Note [mapped pages]: read, not mapped); "tokenize", before it, when this process
# tokenizes: what tokenizing one chunk holds (a file smaller than a chunk is its own chunk), TOKENIZE_PER_BYTE
# per byte of it, measured on 2026-11-28 (1 MiB chunks of text through a 300-token byte-level BPE, ~0.85 tokens
# per byte, the most tokens per byte of a real tokenizer: +56 MiB over the process's RSS; records are counted at
# the same rate, unmeasured; bytes of a .gz corpus or of text records: the chunk and its copy). The same day,
# encode_text alone on one 1 MiB chunk (peak over the RSS before it, generated lines, BPEs trained on them) held
# 41 B per byte at 0.84 tokens per byte (300 ids), 22 B at 0.30 (4096 ids) and 13 B at 0.16 (8298 ids): about
# 7 B + 41 B per token. So the term is a bound, ~35-45 MiB over for tokenizers of real vocabularies (a transient
# term: it is the peak only when the training's terms are smaller). The peak is the larger of the training's
# terms plus "data" and the runtime plus "tokenize".
TOKENIZE_PER_BYTE = 56  # bytes held per byte of the chunk being tokenized (measured: +56 MiB for 1 MiB chunks)


def reader_modules(job: Job) -> tuple[str, ...]:
    """What reading the job's data adds to the estimate's runtime probe, beside the model's modules (models/build.py
    `runtime_modules`, Note [peak memory] runtime): `read:SUFFIX` for each kind of record file read with a library
    (Note [text records]: pyarrow for parquet and arrow files, Hugging Face datasets for .json files), whose probe
    reads a sample of that kind as the run reads its data: the libraries' import (~60 MiB for pyarrow) and what
    reading first loads (~65 MiB more for a parquet file on 2026-11-28, the same for row groups of 256 to 4,096
    records of 4 KiB, pyarrow's pool at 12-17 MiB of it; the job's peak was 7% over its prediction without it)."""
    from infinity.data.sources import resolve
    found = []
    for path, key in ((job.data.path, "data.path"), (job.data.val_path, "data.val_path")):
        try:
            found += list(resolve(path, key).files) if path else []
        except ConfigError:  # (the job's start names it)
            pass
    suffixes = {f.suffix.lower() for f in found}
    return tuple(f"read:{suffix}" for suffix in (".arrow", ".json", ".parquet") if suffix in suffixes)


def resident_bytes(job: Job, world: int, accum: int, *, cuda: bool) -> dict[str, int]:
    """The data pipeline's terms of the estimate's peak, bytes of one rank (Note [data in the estimate])."""
    from infinity.data.ahead import DEPTH
    from infinity.data.shards import CHUNK_BYTES
    job, _ = resolve_data_format(job)
    b, t = job.run.batch_size, job.model.seq_len
    records = job.data.format != "text"
    where = tokenizer_dir(job.model)
    micro = b * t * 8 * (3 if records else 2)
    micro += micro // world
    if records and not cuda:
        micro += b // world * t * t * (4 + 3)  # the fp32 mask and three [B, T, T] bool intermediates
    item = 4 if where else 1
    pages = b * (t + 1) * item * (3 if records else 1)  # the windows read (Note [mapped pages]: nothing mapped)
    from infinity.data.sources import resolve
    try:
        found = resolve(job.data.path)
    except ConfigError:  # (the job's start names it)
        found = None
    file = max(found.files, key=lambda f: f.stat().st_size) if found else None
    packed = found is not None and (file.suffix == ".gz" or found.records)  # (read whole, or in record batches)
    size = file.stat().st_size * (4 if packed else 1) if found else CHUNK_BYTES
    chunk = min(size, CHUNK_BYTES)  # (a chunk of a small file is the file)
    if records or where:
        tokenize = TOKENIZE_PER_BYTE * chunk
    else:
        tokenize = 2 * chunk if packed else 0
    return {"data": (DEPTH + 2) * accum * micro + pages, "tokenize": tokenize}
