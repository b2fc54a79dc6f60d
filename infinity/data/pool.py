"""The pool that tokenizes the job's data (Note [parallel tokenizing] in shards.py): the chunks' encoders and
the ordered map over a pool of processes."""

from __future__ import annotations

import collections
import os
from typing import Iterable, Iterator

import numpy as np

IGNORE = -100
POOL_MIN_BYTES = 1 << 20  # smaller inputs are tokenized in this process (Note [parallel tokenizing] in shards.py)
_WORKER: dict = {}


def _init_worker(where: str | None, tokenizer, settings: dict) -> None:
    """A pool process's tokenizer (loaded from `where`), or this process's own (`tokenizer`)."""
    if tokenizer is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    _WORKER.update(tokenizer=tokenizer, **settings)


def _ids_array(rows: list[list[int]], dtype) -> np.ndarray:
    import itertools
    total = sum(len(r) for r in rows)
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=dtype, count=total)


LINES_PER_BATCH = 4096  # lines per call of the tokenizer's batch API (today's one-call path's batches)
CHECK_LINES = 64  # lines of each chunk encoded by both APIs (Note [parallel tokenizing])


def _encode_lines(tokenizer, lines: list[str]) -> list[list[int]]:
    return tokenizer(lines, add_special_tokens=False, verbose=False)["input_ids"]


def encode_text(chunk: bytes) -> np.ndarray:
    """The ids of a chunk of text, as today's tokenization gives them: each line on its own, no special tokens.
    A fast tokenizer's backend (`backend_tokenizer.encode_batch`, what its `__call__` runs, without building a
    BatchEncoding of Python lists: ~2x the rate) encodes them, once the first CHECK_LINES lines of the chunk gave
    the same ids both ways; otherwise, the tokenizer's batch API. Each batch of lines becomes an array at once
    (not a list of Python ints for the whole chunk)."""
    tokenizer = _WORKER["tokenizer"]
    dtype = _WORKER["dtype"]
    lines = chunk.decode("utf-8", errors="replace").splitlines(keepends=True)
    backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
    if backend is not None:
        head = lines[:CHECK_LINES]
        if [e.ids for e in backend.encode_batch(head, add_special_tokens=False)] != _encode_lines(tokenizer, head):
            backend = None
    parts = []
    for i in range(0, len(lines), LINES_PER_BATCH):
        batch = lines[i:i + LINES_PER_BATCH]
        rows = ([e.ids for e in backend.encode_batch(batch, add_special_tokens=False)] if backend is not None
                else _encode_lines(tokenizer, batch))
        parts.append(_ids_array(rows, dtype))
    return np.concatenate(parts) if parts else np.empty(0, dtype)


def render_records(chunk: list[tuple[str, dict]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, mask, lengths) of the samples of a chunk of records (samples.render_sample; those with no token to
    train on left out, as load_samples does)."""
    from infinity.data.samples import render_sample
    ids: list[list[int]] = []
    masks: list[list[int]] = []
    for where, record in chunk:
        sample = render_sample(_WORKER["tokenizer"], record, _WORKER["data"], _WORKER["seq_len"], where)
        if sample is None:
            continue
        mask = [0 if t == IGNORE else 1 for t in sample.labels]
        if any(t != IGNORE and t != i for t, i in zip(sample.labels, sample.ids)):
            raise ValueError(f"{where}: a label that is neither its id nor -100 cannot be stored as a mask")
        ids.append(sample.ids)
        masks.append(mask)
    return (_ids_array(ids, _WORKER["dtype"]), _ids_array(masks, np.uint8),
            np.array([len(r) for r in ids], dtype=np.int64))


def workers_for(size: int, workers: int | None = None, *, threaded: bool = False) -> int:
    """Processes for tokenizing an input of `size` bytes (Note [parallel tokenizing]): `workers` when given;
    else this process alone for a `threaded` encoder (a fast tokenizer's batch encode runs on every core
    already) or a small input, and a process per core otherwise."""
    if workers is not None:
        return max(1, workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if threaded or size < POOL_MIN_BYTES else cores


def ordered_map(fn, chunks: Iterable, workers: int, where: str | None, tokenizer, settings: dict) -> Iterator:
    """fn(chunk) of each chunk, in order: in this process (workers 1) or in a pool of `workers` forked processes
    with at most 2 * workers chunks in flight. (Forked, not spawned: a spawned process runs the caller's main
    script again, and a script that calls the job without `if __name__ == "__main__"` would start itself over.
    The job forks before its engine starts any thread; the children use no torch, and their tokenizers run on
    one thread each.)"""
    if workers <= 1:
        _init_worker(None, tokenizer, settings)
        for chunk in chunks:
            yield fn(chunk)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_worker,
                             initargs=(where, None, settings)) as pool:
        pending: collections.deque = collections.deque()
        try:
            for chunk in chunks:
                pending.append(pool.submit(fn, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


