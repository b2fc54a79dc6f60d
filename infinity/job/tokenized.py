"""The job's data as token ids for one rank: the corpus as bytes or as the pretrained model's tokenizer gives
them (data.format = "text"), or completion / chat samples (samples.py) rendered by that tokenizer."""

from __future__ import annotations

import torch

from infinity.config.options import ConfigError
from infinity.job.build import need_transformers, tokenizer_dir
from infinity.job.spec import Job


def corpus_tokens(job: Job) -> torch.Tensor:
    """The job's corpus as token ids: bytes (uint8), or int32 ids of the pretrained model's tokenizer."""
    from infinity.job.data import load_tokens
    raw = load_tokens(job.data.path)
    where = tokenizer_dir(job.model)
    if where is None:
        return raw
    transformers = need_transformers(f"model.pretrained = {where!r}", 'or --set model.tokenizer=bytes')
    tokenizer = _tokenizer(job, where)
    lines = bytes(raw.numpy()).decode("utf-8", errors="replace").splitlines(keepends=True)
    ids: list[int] = []
    for i in range(0, len(lines), 4096):  # batches of lines: a fast tokenizer encodes them in parallel
        chunk = tokenizer(lines[i:i + 4096], add_special_tokens=False, verbose=False)["input_ids"]
        for row in chunk:
            ids.extend(row)
    tokens = torch.tensor(ids, dtype=torch.int32)
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
    from infinity.job.samples import SampleBatches, load_samples, split_samples
    where = tokenizer_dir(job.model)
    if where is None:
        raise ConfigError(f"data.format = {job.data.format!r} needs a tokenizer: set model.pretrained to a model "
                          f"directory with its tokenizer saved in it (and model.tokenizer = \"auto\"), or use "
                          f'data.format = "text"')
    tokenizer = _tokenizer(job, where)
    samples = load_samples(job.data, tokenizer, where, job.model.seq_len)
    if job.data.val_path:
        train, val = samples, load_samples(job.data, tokenizer, where, job.model.seq_len, job.data.val_path)
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

    from infinity.job.samples import resolve_format
    fmt, said = resolve_format(job.data)
    if fmt == job.data.format:
        return job, None
    return dataclasses.replace(job, data=dataclasses.replace(job.data, format=fmt)), said


def job_batches(job: Job, rank: int = 0, world: int = 1):
    """The job's training and validation batches for one rank (data.py's sampler over `corpus_tokens`, or
    samples.py's over completion / chat records; data.format resolved by `resolve_data_format`, whose line the
    job prints)."""
    from infinity.job.data import Batches, split
    job, _ = resolve_data_format(job)
    if job.data.format != "text":
        return sample_batches(job, rank, world)
    train, val = split(corpus_tokens(job), job.data.val_fraction, job.model.seq_len)
    return Batches(train, val, seq_len=job.model.seq_len, global_batch=job.run.batch_size, seed=job.data.seed,
                   rank=rank, world=world)
