"""data.path as a directory or a glob pattern, and text records (Note [data of several files], Note [text
records]): the corpus is the files' ids end to end in path order, against references built by hand from the
files' bytes or the tokenizer's own output; the validation part is the tail of each file; parquet / arrow text
is the ids of the same text in a .txt file; one shard for all the files, made again when one changes; a resume
names the file that changed."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from test_finetune_data import _varied_chats, write_jsonl  # noqa: E402

from infinity.config.options import ConfigError  # noqa: E402
from infinity.data.batches import SHIPPED_PATH, Batches, byte_tokens, split  # noqa: E402
from infinity.data.samples import load_samples  # noqa: E402
from infinity.data.sources import READ_ROWS, TokenStream, resolve, stream_records, write_sample  # noqa: E402
from infinity.data.tokenized import corpus_tokens, job_batches, prepare, reader_modules  # noqa: E402
from infinity.job.spec import load_job  # noqa: E402

KJV = gzip.decompress(SHIPPED_PATH.read_bytes())


def _corpus(tmp_path):
    """A directory of three text files (one .gz, one in a subdirectory with a suffix of its own, unequal sizes),
    a hidden file and a token cache that are not data; the files' bytes in path order."""
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    texts = {"a.txt": KJV[:40_000], "b.txt.gz": KJV[40_000:100_000], "sub/c.text": KJV[100_000:112_000]}
    for name, raw in texts.items():
        (d / name).write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    (d / ".notes").write_text("not data\n")
    (d / ".infinity-tokens").mkdir()
    (d / ".infinity-tokens" / "x.bin").write_bytes(b"\x00" * 64)
    return d, [texts[k] for k in sorted(texts)]


def test_a_directory_of_byte_text_is_its_files_end_to_end_with_each_files_tail_held_out(tmp_path):
    """Bytes of a directory: its files (not hidden ones) in path order, end to end, a plain file mapped in place;
    the validation part is the last val_fraction of each file. The batches equal those of the same bytes cut by
    hand into tensors (the reference: numpy over the raw bytes). Planted: the split as one tail of the whole
    (the validation part from the last file only) -> the tails differ, the test fails."""
    d, raws = _corpus(tmp_path)
    ids = byte_tokens(str(d))
    assert isinstance(ids, TokenStream) and [len(p) for p in ids.parts] == [len(r) for r in raws]
    assert bytes(np.asarray(ids)) == b"".join(raws)
    assert str(ids.parts[0].filename) == str(d / "a.txt")  # in place, no copy
    train, val = split(ids, 0.1, 32)
    heads = b"".join(r[:len(r) - int(len(r) * 0.1)] for r in raws)
    tails = b"".join(r[len(r) - int(len(r) * 0.1):] for r in raws)
    assert bytes(np.asarray(train)) == heads and bytes(np.asarray(val)) == tails
    as_tensor = lambda raw: torch.frombuffer(bytearray(raw), dtype=torch.uint8)  # noqa: E731
    ours = Batches(train, val, seq_len=32, global_batch=8, seed=5)
    want = Batches(as_tensor(heads), as_tensor(tails), seq_len=32, global_batch=8, seed=5)
    for step in range(6):
        for got, ref in zip(ours.batch(step, 0), want.batch(step, 0)):
            assert torch.equal(got, ref)
    for got, ref in zip(ours.val_batches(2), want.val_batches(2)):
        assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # a window that crosses a file's end reads both files
    assert bytes(train.read(len(raws[0]) - int(len(raws[0]) * 0.1) - 5, 10)) == heads[len(raws[0]) -
                                                                                      int(len(raws[0]) * 0.1) - 5:][:10]


def test_a_glob_takes_the_files_it_matches_in_path_order(tmp_path):
    d, raws = _corpus(tmp_path)
    found = resolve(str(d / "**" / "[ac].*"))
    assert [found.name(f) for f in found.files] == ["a.txt", "sub/c.text"]
    assert bytes(np.asarray(byte_tokens(str(d / "**" / "[ac].*")))) == raws[0] + raws[2]
    with pytest.raises(ConfigError, match="matches no file"):
        resolve(str(d / "*.parquet"))


def test_a_directory_tokenized_is_each_files_ids_in_one_shard_made_again_when_a_file_changes(tmp_path, llama,
                                                                                                monkeypatch):
    """A pretrained tokenizer over a directory: each file's ids as the tokenizer gives them (each line on its
    own), end to end, in one shard whose meta.json counts each file's ids; the second start maps it without
    tokenizing; a file added makes a new shard with the new file's ids. Planted: the counts of the parts swapped
    -> the parts' lengths differ, the test fails."""
    from infinity.data import pool
    path, tok = llama
    d, raws = _corpus(tmp_path)
    job = load_job(None, [f"model.pretrained={path}", f"data.path={d}", "model.seq_len=32"])
    ids = corpus_tokens(job)

    def reference(raw: bytes) -> list[int]:
        rows = tok(raw.decode().splitlines(keepends=True), add_special_tokens=False)["input_ids"]
        return [t for row in rows for t in row]
    want = [reference(r) for r in raws]
    assert [len(p) for p in ids.parts] == [len(w) for w in want]
    assert np.asarray(ids).tolist() == [t for w in want for t in w]
    shards = list((d / ".infinity-tokens").glob("*.shard"))
    assert len(shards) == 1 and json.loads((shards[0] / "meta.json").read_text())["parts"] == [len(w) for w in want]
    calls = []
    real = pool.encode_text
    monkeypatch.setattr(pool, "encode_text", lambda chunk: calls.append(1) or real(chunk))
    assert np.asarray(corpus_tokens(job)).tolist() == np.asarray(ids).tolist() and not calls
    (d / "z.txt").write_bytes(KJV[200_000:203_000])  # (last in path order)
    more = corpus_tokens(job)
    assert calls and len(list((d / ".infinity-tokens").glob("*.shard"))) == 2
    assert np.asarray(more.parts[-1]).tolist() == reference(KJV[200_000:203_000])
    lines = prepare(job)
    assert len(lines) == 1 and lines[0].startswith(f"{d} (4 files): {len(more):,} token ids (uint16); read from "
                                                   f"{d / '.infinity-tokens' / 'corpus.'}")


@pytest.mark.parametrize("kind", ["parquet", "arrow", "arrow-file", "jsonl"])
def test_text_records_are_the_ids_of_the_same_text_in_a_text_file(tmp_path, llama, kind):
    """Note [text records]: a parquet / arrow / jsonl file of documents ("text" column, another column beside it)
    under data.format = "text" gives the ids of a .txt file holding the texts, each ending with a line end
    (the reference: the job's own path over that .txt file), with the tokenizer and as bytes; a record without
    the field is refused naming data.text_field."""
    path, _ = llama
    docs = [KJV[i * 700:(i + 1) * 700 - (i % 3)].decode() for i in range(60)]  # some end with a line end
    f = tmp_path / f"docs.{kind.split('-')[0]}"
    table = pa.table({"text": docs, "id": list(range(len(docs)))})
    if kind == "parquet":
        pq.write_table(table, f, row_group_size=16)
    elif kind.startswith("arrow"):  # an IPC stream (datasets.save_to_disk's) or an IPC file, in batches of 25
        new = pa.ipc.new_stream if kind == "arrow" else pa.ipc.new_file
        with pa.OSFile(str(f), "wb") as out, new(out, table.schema) as w:
            w.write_table(table, max_chunksize=25)
    else:
        write_jsonl(f, [{"text": t, "id": i} for i, t in enumerate(docs)])
    same = tmp_path / "same.txt"
    same.write_text("".join(t if t.endswith("\n") else t + "\n" for t in docs))
    for tokenizer in ([f"model.pretrained={path}"], []):
        got = corpus_tokens(load_job(None, tokenizer + [f"data.path={f}", "model.seq_len=32"]))
        want = corpus_tokens(load_job(None, tokenizer + [f"data.path={same}", "model.seq_len=32"]))
        assert np.asarray(got).tolist() == np.asarray(want).tolist() and len(got) > 10_000
    assert reader_modules(load_job(None, [f"data.path={f}"])) == \
        {"parquet": ("read:.parquet",), "arrow": ("read:.arrow",), "jsonl": ()}[kind.split("-")[0]]
    with pytest.raises(ConfigError, match=r"no field 'body' \(it has \['id', 'text'\]\).*set it to the field"):
        corpus_tokens(load_job(None, [f"data.path={f}", "data.text_field=body", "model.seq_len=32"]))
    with pytest.raises(ConfigError, match=r'data.text_field = "body" has no effect with data.format = "chat"'):
        load_job(None, [f"data.path={f}", "data.format=chat", "data.text_field=body"]).data.check_format_keys()


def test_records_of_several_files_are_each_files_samples_with_each_files_tail_held_out(tmp_path, llama):
    """Chat records in two .jsonl files and a parquet file: the samples of each file (load_samples, the
    reference) end to end, the validation samples the last val_fraction of each file."""
    path, tok = llama
    d = tmp_path / "chats"
    d.mkdir()
    chats = list(_varied_chats(50))
    parts = {"a.jsonl": chats[:20], "b.jsonl": chats[20:32], "c.parquet": chats[32:]}
    write_jsonl(d / "a.jsonl", parts["a.jsonl"])
    write_jsonl(d / "b.jsonl", parts["b.jsonl"])
    pq.write_table(pa.Table.from_pylist(parts["c.parquet"]), d / "c.parquet")
    job = load_job(None, [f"model.pretrained={path}", f"data.path={d}", "model.seq_len=64", "run.batch_size=2",
                          "data.val_fraction=0.2", "data.format=chat"])
    batches = job_batches(job)
    want = [load_samples(job.data, tok, str(path), 64, str(d / name)) for name in sorted(parts)]
    key = lambda samples: [(s.ids, s.labels) for s in samples]  # noqa: E731
    assert key(batches.train) == [k for w in want for k in key(w[:len(w) - int(len(w) * 0.2)])]
    assert key(batches.val) == [k for w in want for k in key(w[len(w) - int(len(w) * 0.2):])]
    assert len(batches.val) == 4 + 2 + 3


def test_a_resume_names_the_file_added_to_or_changed_in_the_directory(tmp_path):
    """Note [changed data file] for a directory: the checkpoint records each file's SHA-256; a file added or
    changed since is named by `--resume`'s refusal."""
    from infinity.job.resume import _changed_files, data_fingerprint
    d, _ = _corpus(tmp_path)
    job = load_job(None, [f"data.path={d}"])
    before = data_fingerprint(job)
    assert set(before) == {"data.path", "data.path:a.txt", "data.path:b.txt.gz", "data.path:sub/c.text"}
    (d / "a.txt").write_bytes(KJV[:40_001])
    (d / "z.txt").write_bytes(KJV[:100])
    after = data_fingerprint(job)
    assert after["data.path"] != before["data.path"]
    assert _changed_files(before, after, "data.path") == "changed: a.txt; added: z.txt"


@pytest.mark.parametrize("suffix", [".parquet", ".arrow", ".json"])
def test_the_probes_sample_of_each_kind_reads_as_a_runs_data(tmp_path, suffix):
    """Note [peak memory] runtime: the estimate's runtime probe reads, for each kind of record file a job's data is
    in (`reader_modules`), a sample written by write_sample, through the run's own reader: two batches of texts."""
    file = write_sample(suffix, tmp_path)
    assert file.suffix == suffix and reader_modules(load_job(None, [f"data.path={file}"])) == (f"read:{suffix}",)
    rows = [record for _, record in stream_records(file, "data.path")]
    assert len(rows) == 2 * READ_ROWS and all(r["text"].startswith(f"record {i} ") for i, r in enumerate(rows))
