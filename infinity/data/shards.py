"""Token shards: the job's data as token ids on disk, read per batch through a memory map.

Note [token shards]: a data file becomes, once, a directory `.infinity-tokens/<file name>.<key>.shard/` beside
it (in the user's cache directory when the data's directory cannot be written; the key: Note [tokenized data
cache] in tokenized.py) holding

    ids.bin       every token id end to end, in the smallest dtype that holds the vocabulary (uint8 for 256
                  ids, uint16 up to 65536, else uint32)
    mask.bin      records only: uint8, 1 where the loss counts (the label is the id itself), 0 where it is -100
    offsets.bin   records only: int64, the boundaries of the samples (sample i is ids[offsets[i]:offsets[i+1]])
    meta.json     written last: the key, the dtype, the counts, the largest id

and the job reads it with numpy memory maps: a batch touches the pages of its own windows and samples, so the
job's resident memory does not grow with the corpus. The directory is written as `<name>.tmp-<pid>` and renamed
into place when complete (a crash leaves no shard that looks whole); a shard whose meta.json is missing or
unreadable, or whose files are not the sizes it states, is damaged: it is said so and made again. A plain-text
corpus of byte tokens needs no shard: the file itself is its uint8 ids (mapped after a streaming UTF-8 check).

Note [parallel tokenizing]: the text is cut into chunks of about 1 MiB at line ends (today's tokenization encodes
each line on its own, so the cut changes no id) and the records into chunks of 256 records. A fast tokenizer
encodes text in this process with its backend's batch encode, which runs on every core already (what
`tokenizer(lines)` runs, without building a BatchEncoding of Python lists: measured ~2x the public call's rate;
each chunk's first 64 lines are encoded both ways and must agree, else the public call encodes it). Records (a
chat template renders each prefix of a conversation in Python) and slow tokenizers are encoded by a pool of
forked processes, one per core, their tokenizers on one thread each, for inputs of 1 MiB or more; the results are
written in order, at most 2 chunks per process in flight. A progress line on stderr says the bytes read, the
tokens per second and the time left.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import hashlib
import json
import os
import shutil
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from infinity.config.options import ConfigError

SHARD_FORMAT = 1
CHUNK_BYTES = 1 << 20  # text per chunk
RECORDS_PER_CHUNK = 256


class DamagedShard(Exception):
    """A shard directory that is not whole (Note [token shards]); the message says why."""


def smallest_dtype(vocab: int) -> np.dtype:
    """The smallest unsigned dtype that holds the ids 0 .. vocab - 1."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if vocab <= np.iinfo(dt).max + 1:
            return np.dtype(dt)
    return np.dtype(np.int64)


def _map(path: Path, dtype, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


@dataclass
class Shard:
    """A shard's memory maps (Note [token shards])."""

    where: Path
    meta: dict
    ids: np.ndarray
    mask: np.ndarray | None = None
    offsets: np.ndarray | None = None

    @property
    def resident_bound(self) -> int:
        """Bytes of the shard's files (the most its maps can hold resident)."""
        return sum(a.nbytes for a in (self.ids, self.mask, self.offsets) if a is not None)


def open_shard(where: Path) -> Shard:
    """The shard in `where`, mapped; DamagedShard when it is not whole."""
    try:
        meta = json.loads((where / "meta.json").read_text())
        dtype = np.dtype(meta["dtype"])
        n, records = int(meta["tokens"]), meta.get("samples")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DamagedShard(f"its meta.json is missing or unreadable ({type(e).__name__})") from None
    if meta.get("format") != SHARD_FORMAT:
        raise DamagedShard(f"it is of shard format {meta.get('format')}, not {SHARD_FORMAT}")
    parts = meta.get("parts")  # several files' counts (Note [data of several files] in sources.py)
    if parts is not None and (not isinstance(parts, list) or sum(parts) != int(records if records is not None
                                                                                 else n)):
        raise DamagedShard(f"its files' counts in meta.json do not add up to its {'samples' if records else 'tokens'}")
    want = {"ids.bin": n * dtype.itemsize}
    if records is not None:
        want.update({"mask.bin": n, "offsets.bin": (int(records) + 1) * 8})
    for name, size in want.items():
        try:
            have = os.path.getsize(where / name)
        except OSError:
            raise DamagedShard(f"{name} is missing") from None
        if have != size:
            raise DamagedShard(f"{name} has {have} bytes, not the {size} its meta.json states")
    shard = Shard(where, meta, _map(where / "ids.bin", dtype, n))
    if records is not None:
        shard.mask = _map(where / "mask.bin", np.uint8, n)
        shard.offsets = _map(where / "offsets.bin", np.int64, int(records) + 1)
    return shard


RELEASE_EVERY = 16  # global batches between releases of the maps' pages (Note [mapped pages])



def release_pages(*sources) -> None:
    """Note [mapped pages]: the pages of a memory map that are read stay mapped into the process and count in
    its RSS (as file pages: clean, the kernel may drop them, but a run's peak RSS would climb towards the
    corpus's size as random windows touch it all). A fault maps more than the page read: on ext4 with large
    folios (Linux 6.x, this machine) reading one byte of a cached file mapped 2 MiB, so even one batch of 16
    windows mapped 15 MiB of a 24 MiB corpus, and releasing the pages after each batch would still leave the
    batch size times 2 MiB in the peak. So the batches read their windows and samples with pread from the file
    behind the map (`read_range`: the page cache serves them, nothing is mapped) and the map serves only
    metadata (lengths, views). What else touches the map (a user's own indexing) is released every
    RELEASE_EVERY global batches: MADV_DONTNEED on the maps of `sources` (arrays, objects with `.ids` /
    `.mask` / `.offsets`, or with `.parts` of those)."""
    import mmap
    for source in sources:
        if hasattr(source, "parts"):  # several files (sources.TokenStream, sources.SampleChain)
            release_pages(*source.parts)
            continue
        arrays = [source] if isinstance(source, np.ndarray) else \
            [getattr(source, k, None) for k in ("ids", "mask", "offsets")]
        for a in arrays:
            mm = getattr(a, "_mmap", None)  # (numpy.memmap's map; a view shares its base's)
            if mm is not None and hasattr(mmap, "MADV_DONTNEED"):
                try:
                    mm.madvise(mmap.MADV_DONTNEED)
                except (OSError, ValueError):  # closed, or a platform without it: the pages stay (no error)
                    pass


_FDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a map -> the descriptor its reads use


def read_range(array: np.ndarray, start: int, count: int) -> np.ndarray | None:
    """array[start:start + count] read from the file behind a memory map with pread, without mapping its pages
    (Note [mapped pages]); None when `array` is not a map of a file (read it by indexing)."""
    mm = getattr(array, "_mmap", None)
    name = getattr(array, "filename", None)
    if mm is None or name is None:
        return None
    import mmap
    base = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    at = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY + (array.ctypes.data - base)
    fd = _FDS.get(mm)
    if fd is None:  # (the file the map was made of: a shard made again under the same name is another map)
        fd = _FDS.setdefault(mm, os.open(name, os.O_RDONLY))
        weakref.finalize(mm, os.close, fd)
    size = array.dtype.itemsize
    raw = os.pread(fd, count * size, at + start * size)
    if len(raw) != count * size:
        raise OSError(f"{name}: {len(raw)} bytes read at {at + start * size}, not {count * size}: the file "
                      f"changed while the job read it")
    return np.frombuffer(raw, dtype=array.dtype)


class ShardWriter:
    """Writes a shard into `<final>.tmp-<pid>` and renames it into place on `commit` (Note [token shards])."""

    def __init__(self, final: Path, dtype: np.dtype, records: bool):
        self.final, self.dtype, self.records = final, np.dtype(dtype), records
        self.tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        self.files = {"ids": open(self.tmp / "ids.bin", "wb")}
        if records:
            self.files["mask"] = open(self.tmp / "mask.bin", "wb")
            self.files["offsets"] = open(self.tmp / "offsets.bin", "wb")
            self.files["offsets"].write(np.zeros(1, np.int64).tobytes())
        self.tokens, self.samples, self.max_id = 0, 0, -1

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, lengths: np.ndarray | None = None) -> None:
        if len(ids):
            top = int(ids.max())
            if top > np.iinfo(self.dtype).max:
                raise ValueError(f"token id {top} does not fit {self.dtype}")
            self.max_id = max(self.max_id, top)
        self.files["ids"].write(np.ascontiguousarray(ids, dtype=self.dtype).tobytes())
        if self.records:
            self.files["mask"].write(np.ascontiguousarray(mask, dtype=np.uint8).tobytes())
            ends = self.tokens + np.cumsum(lengths, dtype=np.int64)
            self.files["offsets"].write(ends.tobytes())
            self.samples += len(lengths)
        self.tokens += len(ids)

    def commit(self, meta: dict) -> Shard:
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        meta = {**meta, "format": SHARD_FORMAT, "dtype": self.dtype.name, "tokens": self.tokens,
                "max_id": self.max_id, **({"samples": self.samples} if self.records else {})}
        with open(self.tmp / "meta.json", "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.rename(self.tmp, self.final)
        except OSError:  # another process (a rank) put one there first, or a damaged one is in the way
            try:
                shard = open_shard(self.final)
                self.abort()
                return shard
            except DamagedShard:
                shutil.rmtree(self.final, ignore_errors=True)
                os.rename(self.tmp, self.final)
        from io_engine.files import fsync_dir
        fsync_dir(self.final.parent)
        return open_shard(self.final)

    def abort(self) -> None:
        for f in self.files.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---------------------------------------------------------------- the cache

CACHE_DIR = ".infinity-tokens"  # beside the data file (Note [tokenized data cache] in tokenized.py)
CACHE_FORMAT = 1


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


def cache_key(data_file: Path, tokenizer_where: str | None, settings: dict,
              files: list[tuple[str, Path]] | None = None) -> str:
    """The key of a data file's token ids (Note [tokenized data cache]); `tokenizer_where` None: byte tokens;
    `files`: (name, file) of several files read as one (Note [data of several files] in sources.py), keyed by
    each one's name and bytes."""
    several, files, version = files, {}, None
    if tokenizer_where is not None:
        from importlib.metadata import version as installed

        from infinity.models.build import TOKENIZER_IDENTITY_FILES
        files = {name: file_sha256(Path(tokenizer_where, name)) for name in TOKENIZER_IDENTITY_FILES
                 if os.path.isfile(os.path.join(tokenizer_where, name))}
        version = installed("transformers")  # (transformers.__version__, without importing it)
    data = file_sha256(data_file) if several is None else [[name, file_sha256(f)] for name, f in several]
    payload = {"format": CACHE_FORMAT, "data": data, "tokenizer": files, "settings": settings,
               "transformers": version}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def _cache_files(data_file: Path, key: str) -> list[Path]:
    """Where the shard of `data_file` under `key` is looked for: beside the data, then the user's cache."""
    from infinity.machine.link_rates import cache_path
    name = f"{data_file.name}.{key}.shard"
    return [data_file.parent / CACHE_DIR / name, cache_path().parent / "tokens" / name]


def cached(data_file: Path, tokenizer_where: str | None, settings: dict, build: Callable, *, records: bool,
           dtype: Callable[[], np.dtype], files: list[tuple[str, Path]] | None = None) -> Shard:
    """The shard (shards.Shard) of this data file (or of several `files`, placed and named by `data_file`:
    sources.DataInput.anchor), tokenizer and settings: mapped from the cache when it holds a whole one, else
    written there by `build(writer)` (which returns the shard's extra meta). A damaged shard is said so and made
    again (Note [tokenized data cache], Note [token shards])."""
    key = cache_key(data_file, tokenizer_where, settings, files)
    what = data_file if files is None else f"the {len(files)} files of {data_file.parent}"
    places = _cache_files(data_file, key)
    for place in places:
        if place.exists():
            try:
                return open_shard(place)
            except DamagedShard as e:
                print(f"note: the token cache {place} is damaged ({e}): tokenizing {what} again",
                      file=sys.stderr, flush=True)
                shutil.rmtree(place, ignore_errors=True)
    errors = []
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            writer = ShardWriter(place, dtype(), records)
        except OSError as e:
            errors.append(f"{place.parent}: {e.strerror}")
            continue
        try:
            meta = build(writer)
            data = str(data_file) if files is None else [str(f) for _, f in files]
            return writer.commit({"key": key, "data": data, "settings": settings, **(meta or {})})
        except OSError as e:  # (reading the data names its own errors: ConfigError)
            writer.abort()
            errors.append(f"{place.parent}: {e.strerror or e}")
        except BaseException:
            writer.abort()
            raise
    raise ConfigError(f"the token ids of {data_file} cannot be written ({'; '.join(errors)}): make "
                      f"{places[0].parent} writable, or set INFINITY_CACHE_DIR to a writable directory with room")


# ---------------------------------------------------------------- reading the input


def open_text(file: Path):
    """A binary stream of the file's text (.gz decompressed as it is read)."""
    return gzip.open(file, "rb") if file.suffix == ".gz" else open(file, "rb")


def text_chunks(file: Path, size: int | None = None, check: Callable[[bytes, int, int], None] | None = None
                ) -> Iterator[bytes]:
    """The file's bytes in chunks of about `size` that end at a line end (b"\\n") or the end of the file;
    `check(chunk, offset, lines_before)` sees each chunk first (the UTF-8 check)."""
    offset = lines = 0
    rest, size = b"", size or CHUNK_BYTES
    with open_text(file) as f:
        while True:
            block = f.read(size)
            if not block:
                break
            buf = rest + block
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                rest = buf
                continue
            chunk, rest = buf[:cut], buf[cut:]
            if check:
                check(chunk, offset, lines)
            offset, lines = offset + len(chunk), lines + chunk.count(b"\n")
            yield chunk
    if rest:
        if check:
            check(rest, offset, lines)
        yield rest


class Utf8Check:
    """The streaming UTF-8 check of a text file: `bad(chunk, offset, lines)` raises the caller's error naming the
    line, byte and likely encoding (sources.not_utf8) of the first byte that is not UTF-8."""

    def __init__(self, file: Path, fail: Callable[[int, int, bytes, int], None]):
        self.file, self.fail = file, fail
        self.head = b""

    def __call__(self, chunk: bytes, offset: int, lines: int) -> None:
        if len(self.head) < 1 << 20:
            self.head += chunk[: (1 << 20) - len(self.head)]
        try:
            codecs.utf_8_decode(chunk, "strict", True)
        except UnicodeDecodeError as e:
            self.fail(lines + chunk.count(b"\n", 0, e.start) + 1, offset + e.start, chunk, e.start)


# ---------------------------------------------------------------- progress


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class TokenizeProgress:
    """The progress line of a tokenization on stderr: bytes read of the total, tokens per second, time left
    (redrawn in place on a terminal, a line every 30 s otherwise; nothing for one that ends within a second)."""

    def __init__(self, what: str, total: int, stream=None):
        self.what, self.total, self.stream = what, total, stream or sys.stderr
        self.began = self.last = time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.shown = False

    def line(self, done: int, tokens: int) -> str:
        took = max(time.perf_counter() - self.began, 1e-9)
        left = (self.total - done) / (done / took) if done and self.total > done else 0.0
        return (f"tokenizing {self.what}: {done / 2**20:,.0f} / {self.total / 2**20:,.0f} MiB, "
                f"{tokens / took / 1e6:.2f} M tokens/s, {done / took / 2**20:.1f} MiB/s, ETA {_duration(left)}")

    def update(self, done: int, tokens: int) -> None:
        now = time.perf_counter()
        if now - self.began < 1.0 or now - self.last < (0.5 if self.tty else 30.0):
            return
        self.last, self.shown = now, True
        print(("\r" if self.tty else "") + self.line(done, tokens), end="" if self.tty else "\n",
              file=self.stream, flush=True)

    def done(self, done: int, tokens: int, where: Path) -> None:
        took = time.perf_counter() - self.began
        if took < 1.0 and not self.shown:
            return
        print(("\r" if self.tty else "") + f"tokenized {self.what}: {done / 2**20:,.1f} MiB, {tokens:,} tokens in "
              f"{took:.1f} s ({done / took / 2**20:.2f} MiB/s); cached in {where}", file=self.stream, flush=True)
