"""The pool that tokenizes the job's data (Note [parallel tokenizing] in shards.py): the chunks' encoders and
the ordered map over a pool of processes."""

from __future__ import annotations

import collections
import os
from typing import Iterable, Iterator

import numpy as np

IGNORE = -100
POOL_MIN_BYTES = 16 << 20  # smaller inputs are tokenized in this process (Note [parallel tokenizing] in shards.py)
_WORKER: dict = {}


def _init_worker(where: str | None, tokenizer, settings: dict) -> None:
    """A pool process's tokenizer (loaded from `where`), or this process's own (`tokenizer`)."""
    if tokenizer is None:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism
        import transformers
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    _WORKER.update(tokenizer=tokenizer, **settings)


def _ids_array(rows: list[list[int]], dtype: np.dtype) -> np.ndarray:
    import itertools
    total = sum(len(r) for r in rows)
    return np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=total)


def encode_text(chunk: bytes) -> np.ndarray:
    """The ids of a chunk of text, as today's tokenization gives them: each line on its own, no special tokens,
    the tokenizer's batch API over 4096 lines at a time."""
    tokenizer = _WORKER["tokenizer"]
    lines = chunk.decode("utf-8", errors="replace").splitlines(keepends=True)
    rows: list[list[int]] = []
    for i in range(0, len(lines), 4096):
        rows.extend(tokenizer(lines[i:i + 4096], add_special_tokens=False, verbose=False)["input_ids"])
    return _ids_array(rows, _WORKER["dtype"])


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


def workers_for(size: int, workers: int | None = None) -> int:
    """Processes for tokenizing an input of `size` bytes (Note [parallel tokenizing])."""
    if workers is not None:
        return max(1, workers)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return 1 if size < POOL_MIN_BYTES else cores


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


