"""What `data.path` names (one file, a directory of files, a glob pattern), the records of a file as they stream
past, and several files' token ids read as one stream.

Note [data of several files]: `data.path` and `data.val_path` name one file, a directory, or a glob pattern
(`*`, `?`, `[...]`; `**` for any depth). A directory means every file below it, at any depth, except names that
start with "." (the token cache `.infinity-tokens/` lives there); a pattern, the files it matches. The files are
taken in the order of their paths, so a corpus is the same on every machine and at every start. They are of one
kind: text (plain or .gz) or records (.jsonl, .json, .parquet, .arrow); a mix is refused naming one of each. The
corpus is each file's token ids end to end (a file is tokenized on its own: its last line does not join the next
file's first line), read as one stream (`TokenStream`) or one sequence of samples (`SampleChain`), and the
validation part is the last `data.val_fraction` of *each* file, so that it covers every file (with one file,
exactly the split of one file). Tokenized files are one shard for them all (one pool; its meta.json holds each
file's count) under a key of every file's name and SHA-256 (Note [tokenized data cache] in tokenized.py): a file
added, removed or changed makes a new shard. Byte tokens of plain files need no shard: each file is mapped in
place. A checkpoint records each file's SHA-256 (Note [changed data file] in infinity/job/resume.py).

Note [text records]: records with a text field (`data.text_field`, default "text": how the Hugging Face
datasets of pretraining corpora hold their documents) train as plain text under `data.format = "text"`: each
record's text ends with a line end (one is added when it does not), so the records tokenize exactly as a text
file of those texts would (each line on its own, Note [parallel tokenizing] in shards.py). Every record file is
read as it is consumed, never whole, and nothing is copied to Hugging Face datasets' cache: a .jsonl file line by
line; parquet and arrow files with pyarrow (the engine under datasets), READ_ROWS records at a time, parquet
without pre-buffering, a memory map or threads; a .json file (one array) through datasets' streaming mode.
Measured on 2026-11-28 (2-core machine, a 123 MiB parquet file of 200 MiB of 4 KiB texts): read so, RSS stays
38 MiB over pyarrow's import (63 MiB) from the first row group to the last; datasets' streaming mode of the same
file held 308 MiB over its import (143 MiB) after 50 MiB of text and 369 MiB at the end; pyarrow's defaults
(pre-buffering, threads) grew from 64 to 174 MiB.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from infinity.config.job import SHIPPED
from infinity.config.options import ConfigError

SHIPPED_PATH = Path(__file__).resolve().parents[1] / "corpus" / "kjv.txt.gz"
RECORD_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
GLOB_CHARS = "*?["
READ_ROWS = 1024  # records per batch read from a parquet / arrow / json file (Note [text records])


class DataError(ConfigError):
    """Bad training data: the message names the file and the line (or record)."""


def is_records(file: Path) -> bool:
    return file.suffix.lower() in RECORD_KINDS


@dataclass(frozen=True)
class DataInput:
    """The files a data setting names (Note [data of several files])."""

    given: str  # the setting's value
    key: str  # the setting: "data.path" or "data.val_path"
    files: tuple[Path, ...]
    base: Path  # the directory the files' names are relative to
    several: bool  # a directory or a pattern (even one that found a single file)

    def name(self, file: Path) -> str:
        return file.relative_to(self.base).as_posix() if self.several else file.name

    def say(self, file: Path | None = None) -> str:
        """How an error names the setting (and, for several files, the file)."""
        shown = f"{self.key} = {self.given!r}"
        return f"{shown} ({file})" if self.several and file is not None else shown

    @property
    def records(self) -> bool:
        return is_records(self.files[0])

    @property
    def anchor(self) -> Path:
        """The path the cache is placed and named by (shards.cached): the file, or a name in the directory."""
        if not self.several:
            return self.files[0]
        label = Path(self.given).resolve().name if os.path.isdir(self.given) else Path(self.given).name
        label = "".join("_" if c in GLOB_CHARS + "]" else c for c in label) or "data"
        return self.base / label

    def named(self) -> list[tuple[str, Path]] | None:
        """(name, file) of each file when there are several (the cache key's), else None."""
        return [(self.name(f), f) for f in self.files] if self.several else None


def _glob_base(pattern: str) -> Path:
    parts = []
    for part in Path(pattern).parts:
        if any(c in part for c in GLOB_CHARS):
            break
        parts.append(part)
    return Path(*parts) if parts else Path(".")


def _below(directory: Path) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(directory):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found += [Path(root, n) for n in names if not n.startswith(".")]
    return found


def resolve(path: str, key: str = "data.path") -> DataInput:
    """The files `path` names (Note [data of several files]), or the ConfigError saying what is wrong."""
    if path == SHIPPED and key == "data.path":
        if not SHIPPED_PATH.is_file():
            raise ConfigError(f'data.path = "kjv": the shipped corpus {SHIPPED_PATH} is missing (it is part of the '
                              f"repository; install from a checkout: pip install -e .), or set data.path to a "
                              f"text file")
        return DataInput(path, key, (SHIPPED_PATH,), SHIPPED_PATH.parent, False)
    p = Path(path)
    if p.is_file():
        return DataInput(path, key, (p,), p.parent, False)
    if p.is_dir():
        base, files = p, sorted(_below(p))
        if not files:
            raise ConfigError(f"{key} = {path!r} is a directory with no file in it (names starting with '.' are "
                              f"skipped): put the data files there, or point it at a file")
    elif any(c in path for c in GLOB_CHARS):
        import glob
        base = _glob_base(path)
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if os.path.isfile(f))
        if not files:
            raise ConfigError(f"{key} = {path!r} matches no file (a glob pattern; files whose names start with '.' "
                              f"are not matched): check the pattern, or point {key} at a file or a directory")
    else:
        shipped = ', or "kjv" for the shipped corpus' if key == "data.path" else ""
        raise ConfigError(f"{key} = {path!r}: no such file; point it at a UTF-8 text file (plain or .gz), a .jsonl, "
                          f".json, .parquet or .arrow file of records, a directory of such files or a glob "
                          f"pattern{shipped}")
    text = [f for f in files if not is_records(f)]
    records = [f for f in files if is_records(f)]
    if text and records:
        raise ConfigError(f"{key} = {path!r} holds both text ({text[0]}) and record files ({records[0]}): the files "
                          f"of a corpus are of one kind; point {key} at one kind (a pattern such as "
                          f"'{Path(path, '*.jsonl') if p.is_dir() else path}', or a directory of one kind)")
    return DataInput(path, key, tuple(files), base, True)


# ---------------------------------------------------------------- records as they stream


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




def jsonl_records(file: Path) -> Iterator[tuple[str, dict]]:
    """(where, record) of each line of a .jsonl file, read as consumed; `where` is "FILE line N"."""
    with open(file, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{file} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: {not_utf8(raw, e.start, file)}") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not JSON ({e.msg} at column {e.colno}); each line must be one JSON "
                                f"object") from None
            if not isinstance(record, dict):
                raise DataError(f"{where}: a JSON {type(record).__name__}, not an object; each line must be one "
                                f"JSON object")
            yield where, record


def stream_records(file: Path, say: str, columns: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) of each record of a local record file, read as consumed (Note [text records]); `where` is
    "FILE line N" (.jsonl) or "FILE record N"; `say`: how errors name the setting (DataInput.say); `columns`: the
    fields to read of a parquet file (None: all)."""
    suffix = file.suffix.lower()
    if suffix not in RECORD_KINDS:
        raise ConfigError(f"{say}: {file} is not a .jsonl, .json, .parquet or .arrow file; rename or convert it, "
                          f'or set data.format = "text" to train on it as plain text')
    if suffix == ".jsonl":
        yield from jsonl_records(file)
        return
    n = 0
    try:
        for rows in (_json_batches(file, say) if suffix == ".json" else _arrow_batches(file, say, columns)):
            for row in rows:
                n += 1
                yield f"{file} record {n}", row
    except ConfigError:
        raise
    except Exception as e:  # pyarrow and datasets raise many kinds (ArrowInvalid, DatasetGenerationError, ...)
        raise DataError(f"{file}: it cannot be read as {RECORD_KINDS[suffix]} ({type(e).__name__}: {e}); fix the "
                        f"file") from None


def _need(module: str, say: str, file: Path):
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{say}: reading {file.suffix} files needs Hugging Face datasets (and its pyarrow): "
                          f'pip install "infinity[hf]"') from None


def _arrow_batches(file: Path, say: str, columns: list[str] | None) -> Iterator[list[dict]]:
    """Rows of a parquet file, or of an arrow IPC stream or file (what datasets.save_to_disk writes), READ_ROWS at
    a time: parquet read a row group's pages at a time on this thread, without pre-buffering or a memory map
    (Note [text records]: measured flat in the file's size)."""
    pa = _need("pyarrow", say, file)
    if file.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq
        with pq.ParquetFile(file, memory_map=False, pre_buffer=False, buffer_size=1 << 20) as f:
            have = f.schema_arrow.names
            for batch in f.iter_batches(batch_size=READ_ROWS, use_threads=False,
                                        columns=[c for c in columns if c in have] if columns else None):
                yield batch.to_pylist()
        return
    with pa.OSFile(str(file)) as f:
        try:
            reader = pa.ipc.open_stream(f)
        except pa.ArrowInvalid:  # (not a stream: the IPC file format)
            f.seek(0)
            reader = pa.ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(reader)
        for batch in batches:
            for at in range(0, batch.num_rows, READ_ROWS):
                yield batch.slice(at, READ_ROWS).to_pylist()


def _json_batches(file: Path, say: str) -> Iterator[list[dict]]:
    """Records of a .json file (an array of objects, or JSON lines) through Hugging Face datasets, streamed."""
    datasets = _need("datasets", say, file)
    table = datasets.load_dataset("json", data_files=str(file), split="train", streaming=True)
    for batch in table.iter(batch_size=READ_ROWS):
        columns = list(batch)
        yield [{c: batch[c][i] for c in columns} for i in range(len(batch[columns[0]]) if columns else 0)]


def write_sample(suffix: str, directory: Path) -> Path:
    """A record file of kind `suffix` (.parquet, .arrow or .json) in `directory`, written with the library its
    reader uses: two batches of READ_ROWS records of 4 KiB texts, for the estimate's runtime probe to read as a run
    reads its data (Note [peak memory] runtime: what reading loads and keeps, beyond the libraries' import)."""
    texts = [f"record {i} " + "x" * 4096 for i in range(2 * READ_ROWS)]
    file = directory / f"sample{suffix}"
    if suffix == ".json":
        file.write_text(json.dumps([{"text": t} for t in texts]))
        return file
    import pyarrow as pa
    table = pa.table({"text": texts})
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        pq.write_table(table, file, row_group_size=READ_ROWS)
    else:
        with pa.OSFile(str(file), "wb") as out, pa.ipc.new_stream(out, table.schema) as w:
            w.write_table(table, max_chunksize=READ_ROWS)
    return file


def record_text_chunks(file: Path, field: str, say: str, size: int | None = None) -> Iterator[bytes]:
    """The texts of a record file's `field`, each ending with a line end, in chunks of about `size` bytes (Note
    [text records])."""
    from infinity.data.shards import CHUNK_BYTES
    size = size or CHUNK_BYTES
    held: list[bytes] = []
    count = 0
    for where, record in stream_records(file, say, columns=[field]):
        text = record.get(field)
        if not isinstance(text, str):
            if text is None and file.suffix.lower() == ".parquet":  # (only the field was read: name the file's)
                import pyarrow.parquet as pq
                record = dict.fromkeys(pq.ParquetFile(file).schema_arrow.names, "")
            present = sorted(k for k, v in record.items() if v is not None)
            what = "no field" if text is None else f"a {type(text).__name__} in field"
            raise DataError(f"{where}: {what} {field!r} (it has {present}); data.format = \"text\" reads each "
                            f"record's text from data.text_field: set it to the field that holds the text")
        raw = text.encode("utf-8")
        held.append(raw if raw.endswith(b"\n") else raw + b"\n")
        count += len(held[-1])
        if count >= size:
            yield b"".join(held)
            held, count = [], 0
    if held:
        yield b"".join(held)


# ---------------------------------------------------------------- several files as one


class TokenStream:
    """The token ids of several parts (a file's memory map, or a range of one) end to end, read as one array by
    the batches (`read`: pread from the files, Note [mapped pages] in shards.py)."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)
        self.dtype = np.result_type(*[p.dtype for p in self.parts]) if self.parts else np.dtype(np.uint8)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def read(self, start: int, count: int) -> np.ndarray:
        """ids[start:start + count] across the parts."""
        from infinity.data.shards import read_range
        if start < 0 or start + count > len(self):
            raise IndexError(f"ids {start}..{start + count} of a stream of {len(self)}")
        out = []
        i = int(np.searchsorted(self.ends, start, side="right"))
        while count > 0:
            part = self.parts[i]
            at = start - (int(self.ends[i - 1]) if i else 0)
            n = min(count, len(part) - at)
            if n > 0:
                got = read_range(part, at, n)
                out.append(np.asarray(part[at:at + n]) if got is None else got)
                start, count = start + n, count - n
            i += 1
        return np.concatenate(out).astype(self.dtype, copy=False) if out else np.empty(0, self.dtype)

    def __array__(self, dtype=None, copy=None):
        whole = self.read(0, len(self))
        return whole if dtype is None else whole.astype(dtype)


class SampleChain:
    """The samples of several parts (samples.SampleShard ranges, one per file) as one sequence."""

    def __init__(self, parts: list):
        self.parts = list(parts)
        self.ends = np.cumsum([len(p) for p in self.parts], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, i: int):
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        p = int(np.searchsorted(self.ends, i, side="right"))
        return self.parts[p][i - (int(self.ends[p - 1]) if p else 0)]

    def __iter__(self):
        for part in self.parts:
            yield from part


def split_parts(parts: list, val_fraction: float, floor: int = 0) -> tuple[list, list]:
    """(heads, tails) of each part: its last `val_fraction` held out (Note [data of several files]); at least
    `floor` held out in all (from the last part that has room)."""
    tails = [int(len(p) * val_fraction) for p in parts]
    if sum(tails) < floor:
        for k in range(len(parts) - 1, -1, -1):
            if len(parts[k]) > floor:
                tails[k] = floor
                break
    return ([p[:len(p) - n] for p, n in zip(parts, tails)], [p[len(p) - n:] for p, n in zip(parts, tails)])


def cut(whole, counts: list[int]) -> list:
    """`whole` (an array or samples) cut into consecutive parts of `counts` items."""
    bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
    return [whole[int(a):int(b)] for a, b in zip(bounds[:-1], bounds[1:])]
