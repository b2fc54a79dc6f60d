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
import zlib
from pathlib import Path

import torch

from infinity.config.job import SHIPPED, DataConfig
from infinity.config.options import ConfigError

SHIPPED_PATH = Path(__file__).resolve().parents[1] / "corpus" / "kjv.txt.gz"


def corpus_path(path: str) -> Path:
    """The file behind `data.path` ("kjv" = the shipped corpus)."""
    return SHIPPED_PATH if path == SHIPPED else Path(path)


def corpus_file(path: str) -> Path:
    """The corpus file of `data.path`, or the ConfigError saying what is wrong with it."""
    file = corpus_path(path)
    if file.is_dir():
        raise ConfigError(f"data.path = {path!r} is a directory: point it at a UTF-8 text file inside it (plain "
                          f'or .gz), or use "kjv" for the shipped corpus')
    if not file.is_file():
        if path == SHIPPED:
            raise ConfigError(f'data.path = "kjv": the shipped corpus {file} is missing (it is part of the '
                              f"repository; install from a checkout: pip install -e .), or set data.path to a "
                              f"text file")
        raise ConfigError(f"data.path = {path!r}: no such file; point it at a UTF-8 text file (plain or .gz), "
                          f'or use "kjv" for the shipped corpus')
    return file


def _bad_gzip(path: str, e: Exception) -> ConfigError:
    return ConfigError(f"data.path = {path!r}: the file ends in .gz but is not a valid gzip file ({e}); "
                       f"compress it with gzip, or rename it without .gz if it is plain text")


def _empty(path: str) -> ConfigError:
    return ConfigError(f"data.path = {path!r} is empty: point it at a text file with the training text, or "
                       f'use "kjv" for the shipped corpus')


def text_chunks(path: str):
    """The corpus's text in chunks that end at line ends (shards.text_chunks), each checked to be UTF-8 as it is
    read: the errors of a bad file are load_tokens's."""
    from infinity.data.shards import Utf8Check, text_chunks
    file = corpus_file(path)

    def fail(line: int, at: int, chunk: bytes, local: int) -> None:
        raise ConfigError(f"data.path = {path!r} line {line}: "
                          f"{not_utf8(chunk, local, path, base=at - local, head=check.head)}")
    check = Utf8Check(file, fail)
    seen = False
    try:
        for chunk in text_chunks(file, check=check):
            seen = True
            yield chunk
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise _bad_gzip(path, e) from None
    except OSError as e:
        raise ConfigError(f"data.path = {path!r}: cannot read it ({e.strerror}); check the file's "
                          f"permissions") from None
    if not seen:
        raise _empty(path)


def byte_tokens(path: str):
    """The corpus as uint8 byte tokens, memory-mapped (Note [token shards] in shards.py): a plain text file is
    its own ids (checked to be UTF-8 as it streams past); a .gz file is decompressed once into a shard."""
    import numpy as np
    file = corpus_file(path)
    if file.suffix == ".gz":
        return byte_shard(path, file).ids
    for _ in text_chunks(path):
        pass
    return np.memmap(file, dtype=np.uint8, mode="r")


def load_tokens(path: str) -> torch.Tensor:
    """The corpus as a uint8 tensor of byte tokens, read whole into memory (the job maps it instead:
    `byte_tokens`)."""
    raw = b"".join(text_chunks(path))
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def not_utf8(raw: bytes, at: int, path: str, base: int = 0, head: bytes | None = None) -> str:
    """What is wrong with `raw` (a file's bytes, or one line of them), whose byte `at` is not UTF-8, and the fix.

    Note [text in another encoding]: a file that is not UTF-8 is most often text saved in another encoding (Latin-1
    / Windows-1252 from an older editor, UTF-16 from Windows tools), not binary data: calling it binary sends the
    user looking for the wrong problem. So: a UTF-16 byte-order mark says UTF-16; bytes that read as text in
    Windows-1252 (no NUL, few control bytes) say Latin-1 / Windows-1252 and show the bytes around `at` read so;
    only the rest is called binary. Each names the conversion to UTF-8. (`raw` may be a part of the file that
    starts at byte `base`; `head`: the file's first bytes then.)"""
    bad = f"not UTF-8 text (byte {base + at}: {raw[at:at + 1]!r})"
    head = (raw if head is None else head)[:1 << 20]
    iconv = (f"zcat {path} | iconv -f {{}} -t utf-8 | gzip > utf8.txt.gz" if str(path).endswith(".gz") else
             f"iconv -f {{}} -t utf-8 {path} > utf8.txt")
    convert = f"convert it to UTF-8, e.g. {iconv}, and point data.path at that"
    if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return f"{bad}; the file is UTF-16 text (it starts with a UTF-16 byte-order mark): {convert.format('utf-16')}"
    controls = sum(head.count(bytes([c])) for c in (*range(0, 9), 11, *range(14, 32), 127))
    if b"\x00" not in head and controls <= len(head) // 100:
        lo, hi = max(0, at - 20), at + 20
        lo = raw.rfind(b"\n", lo, at) + 1 or lo
        hi = min(x for x in (raw.find(b"\n", at, hi), hi) if x >= 0)
        seen = raw[lo:hi].decode("cp1252", errors="replace")
        return (f"{bad}; it looks like text in another encoding, Latin-1 or Windows-1252 (read so, it says "
                f"{seen!r}), not binary data: {convert.format('latin1')}")
    return f"{bad}; the file looks binary (NUL or control bytes), not text: point data.path at a UTF-8 text file"


def split(tokens: torch.Tensor, val_fraction: float, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) token ranges; both must hold at least one window of seq_len + 1."""
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
    if isinstance(tokens, torch.Tensor):
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
        train, val = split(byte_tokens(data.path), data.val_fraction, seq_len)
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


def byte_shard(path: str, file: Path):
    """A .gz corpus's bytes as a uint8 shard (decompressed once; Note [token shards])."""
    import numpy as np

    from infinity.data.shards import TokenizeProgress, cached

    def build(writer) -> dict:
        progress = TokenizeProgress(f"{file.name} (decompressing)", 0)
        done = 0
        for chunk in text_chunks(path):
            writer.add(np.frombuffer(chunk, dtype=np.uint8))
            done += len(chunk)
            progress.update(done, done)
        progress.done(done, done, writer.final)
        return {"tokenizer": "bytes"}
    return cached(file, None, {"format": "bytes"}, build, records=False, dtype=lambda: np.dtype(np.uint8))
