"""Training data for `infinity train`: a text corpus as bytes, cut into batches deterministically.

The tokenizer is the identity on bytes (vocabulary 256), so no tokenizer file or
download is needed and any text trains. The shipped corpus is the King James
Bible (public domain; `infinity/corpus/README.md`). The last `data.val_fraction` of the
bytes is held out for the validation loss.

Note [same batches at every world size]: the batch of optimizer step s,
micro-batch m is drawn from a generator seeded by (data.seed, s, m) over the
whole *global* batch; rank r of N takes rows [r * B/N, (r+1) * B/N). So one
process, `--nproc-per-node 2` and two single-process nodes all see the same
samples per step, and a run is reproducible from its config alone.
"""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import torch

from infinity.config.job import SHIPPED, DataConfig
from infinity.config.options import ConfigError
from infinity.data.sources import SHIPPED_PATH, DataInput, TokenStream, not_utf8, record_text_chunks, resolve


def corpus_path(path: str) -> Path:
    """The file behind `data.path` ("kjv" = the shipped corpus)."""
    return SHIPPED_PATH if path == SHIPPED else Path(path)


def corpus_file(path: str) -> Path:
    """The one corpus file of `data.path`, or the ConfigError saying what is wrong with it."""
    found = resolve(path)
    if found.several:
        raise ConfigError(f"data.path = {path!r} names several files here, where one file is read: point it at a "
                          f"UTF-8 text file (plain or .gz)")
    return found.files[0]


def _bad_gzip(say: str, e: Exception) -> ConfigError:
    return ConfigError(f"{say}: the file ends in .gz but is not a valid gzip file ({e}); "
                       f"compress it with gzip, or rename it without .gz if it is plain text")


def empty_corpus(say: str) -> ConfigError:
    return ConfigError(f"{say} is empty: point it at a text file with the training text, or "
                       f'use "kjv" for the shipped corpus')


def text_chunks(path: str, file: Path | None = None, *, say: str | None = None, empty_ok: bool = False):
    """The corpus's text in chunks that end at line ends (shards.text_chunks), each checked to be UTF-8 as it is
    read: the errors of a bad file are load_tokens's. `file`: one file of several that data.path names (`say`
    names both in errors; `empty_ok`: an empty one adds nothing)."""
    from infinity.data.shards import Utf8Check, text_chunks
    file = file or corpus_file(path)
    say = say or f"data.path = {path!r}"

    def fail(line: int, at: int, chunk: bytes, local: int) -> None:
        raise ConfigError(f"{say} line {line}: "
                          f"{not_utf8(chunk, local, str(file), base=at - local, head=check.head)}")
    check = Utf8Check(file, fail)
    seen = False
    try:
        for chunk in text_chunks(file, check=check):
            seen = True
            yield chunk
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise _bad_gzip(say, e) from None
    except OSError as e:
        raise ConfigError(f"{say}: cannot read it ({e.strerror}); check the file's "
                          f"permissions") from None
    if not seen and not empty_ok:
        raise empty_corpus(say)


def input_chunks(found: DataInput, file: Path, text_field: str):
    """The text of one file of `found` in chunks: a text file's (`text_chunks`), or a record file's texts (Note
    [text records])."""
    if found.records:
        return record_text_chunks(file, text_field, found.say(file))
    return text_chunks(found.given, file, say=found.say(file), empty_ok=found.several)


def byte_tokens(path: str, text_field: str = "text"):
    """The corpus as uint8 byte tokens, memory-mapped (Note [token shards] in shards.py): a plain text file is
    its own ids (checked to be UTF-8 as it streams past); a .gz file, or a record file's texts, are written once
    into a shard. Several files (Note [data of several files]): their ids end to end, a TokenStream."""
    import numpy as np
    found = resolve(path)
    parts = []
    for file in found.files:
        if file.suffix == ".gz" or found.records:
            parts.append(byte_shard(found, file, text_field).ids)
            continue
        for _ in input_chunks(found, file, text_field):
            pass
        parts.append(np.memmap(file, dtype=np.uint8, mode="r") if os.path.getsize(file) else
                     np.empty(0, np.uint8))
    if not found.several:
        return parts[0]
    if not sum(len(p) for p in parts):
        raise empty_corpus(f"data.path = {path!r}")
    return TokenStream(parts)


def load_tokens(path: str) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens, read whole into memory (the job maps it instead:
    `byte_tokens`)."""
    raw = b"".join(text_chunks(path))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def split(tokens, val_fraction: float, seq_len: int):
    """(train, validation) token ranges: the last val_fraction held out (of each file: Note [data of several
    files]); both must hold at least one window of seq_len + 1."""
    if isinstance(tokens, TokenStream):
        from infinity.data.sources import split_parts
        heads, tails = split_parts(tokens.parts, val_fraction)
        train, val = TokenStream(heads), TokenStream(tails)
    else:
        n_val = int(len(tokens) * val_fraction)
        train, val = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
    for name, part in (("training", train), ("validation", val)):
        if len(part) < seq_len + 2:
            raise ConfigError(f"the corpus's {name} part has {len(part)} bytes, fewer than one sequence of "
                              f"model.seq_len + 1 = {seq_len + 1}: use a longer text, a smaller model.seq_len, "
                              f"or change data.val_fraction")
    return train, val


def rank_rows(global_batch: int, rank: int, world: int) -> slice:
    """The rows of a global batch that `rank` trains on (Note [same batches at every world size])."""
    if global_batch % world:
        raise ConfigError(f"run.batch_size = {global_batch} is not divisible by the world size {world}: "
                          f"set run.batch_size to a multiple of {world}")
    per = global_batch // world
    return slice(rank * per, (rank + 1) * per)


def windows(tokens, starts: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets (int64, [len(starts), seq_len]) of the windows at `starts`."""
    index = starts[:, None] + torch.arange(seq_len + 1)
    if isinstance(tokens, TokenStream):  # several files (Note [data of several files])
        import numpy as np
        rows = torch.from_numpy(np.stack([tokens.read(int(s), seq_len + 1) for s in starts]).astype(np.int64))
    elif isinstance(tokens, torch.Tensor):
        rows = tokens[index].long()
    else:  # a memory map (Note [token shards]): each window read from its file (Note [mapped pages])
        import numpy as np

        from infinity.data.shards import read_range
        read = [read_range(tokens, int(s), seq_len + 1) for s in starts]
        if any(r is None for r in read):
            rows = torch.from_numpy(np.asarray(tokens[index.numpy()], dtype=np.int64))
        else:
            rows = torch.from_numpy(np.stack(read).astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class RankBatches:
    """Deterministic batches for one rank (Note [same batches at every world size]): the global batch of (optimizer
    step, micro-batch) is a function of the seed alone, and each rank takes its rows of it. A subclass says how a
    seed becomes a global batch of its source (`_batch`): windows of a token stream here, samples in samples.py."""

    loss = None  # the model's own next-token loss (samples.SampleBatches carries a masked one)
    # (a loss is loss(forward, x, y, num_items=None): the mean over y's targets, or their sum over num_items)
    train: object
    val: object
    seed: int
    rows: torch.Tensor

    def _batch(self, source, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def global_batch_at(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole global batch of (optimizer step, micro-batch): every rank's rows."""
        from infinity.data.shards import RELEASE_EVERY, release_pages
        self._read = getattr(self, "_read", 0) + 1
        if self._read % RELEASE_EVERY == 0:  # Note [mapped pages]
            release_pages(self.train, self.val)
        return self._batch(self.train, (self.seed * 1_000_003 + step) * 1009 + micro)

    def batch(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the global batch of (optimizer step, micro-batch)."""
        x, y = self.global_batch_at(step, micro)
        return x[self.rows], y[self.rows]

    def window(self, step: int, accum: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
        """This rank's rows of the `accum` micro-batches of optimizer step `step`, and the window's items: its
        targets that count (not -100) over every micro-batch and every rank's rows (Note [token-weighted
        windows] in runtime/accumulation.py; known here without a collective, Note [same batches at every
        world size])."""
        rows, items = [], 0
        for micro in range(accum):
            x, y = self.global_batch_at(step, micro)
            items += int((y != -100).sum())
            rows.append((x[self.rows], y[self.rows]))
        return rows, items

    def val_batches(self, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`count` fixed validation batches (the same every call), this rank's rows."""
        out = []
        for i in range(count):
            x, y = self._batch(self.val, self.seed + 7 + i)
            out.append((x[self.rows], y[self.rows]))
        return out


class Batches(RankBatches):
    """Deterministic training and validation batches of a token stream for one rank."""

    def __init__(self, train: torch.Tensor, val: torch.Tensor, *, seq_len: int, global_batch: int, seed: int,
                 rank: int = 0, world: int = 1):
        self.train, self.val, self.seq_len, self.seed = train, val, seq_len, seed
        self.global_batch = global_batch
        self.rows = rank_rows(global_batch, rank, world)

    @classmethod
    def from_config(cls, data: DataConfig, *, seq_len: int, global_batch: int, rank: int = 0,
                    world: int = 1) -> "Batches":
        train, val = split(byte_tokens(data.path, data.text_field), data.val_fraction, seq_len)
        return cls(train, val, seq_len=seq_len, global_batch=global_batch, seed=data.seed, rank=rank, world=world)

    def _starts(self, tokens: torch.Tensor, seed: int, count: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, len(tokens) - self.seq_len - 1, (count,), generator=g)

    def _batch(self, tokens: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(tokens, self._starts(tokens, seed, self.global_batch), self.seq_len)

    @property
    def tokens_per_batch(self) -> int:
        """Tokens of one global micro-batch."""
        return self.global_batch * self.seq_len


def byte_shard(found: DataInput, file: Path, text_field: str = "text"):
    """The bytes of a .gz file, or of a record file's texts (Note [text records]), as a uint8 shard (written
    once; Note [token shards])."""
    import numpy as np

    from infinity.data.shards import TokenizeProgress, cached

    def build(writer) -> dict:
        progress = TokenizeProgress(f"{file.name} ({'decompressing' if file.suffix == '.gz' else 'reading'})", 0)
        done = 0
        for chunk in input_chunks(found, file, text_field):
            writer.add(np.frombuffer(chunk, dtype=np.uint8))
            done += len(chunk)
            progress.update(done, done)
        progress.done(done, done, writer.final)
        return {"tokenizer": "bytes"}
    settings = {"format": "bytes", **({"text_field": text_field} if found.records else {})}
    return cached(file, None, settings, build, records=False, dtype=lambda: np.dtype(np.uint8))
