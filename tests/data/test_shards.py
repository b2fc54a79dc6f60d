"""Token shards (Note [token shards], Note [parallel tokenizing], Note [batches ahead]): the ids on disk in the
smallest dtype, equal to the tokenizer's own output whether a pool or this process made them; a damaged or
partial cache is said and made again; the batches built ahead are the loop's own; a resumed job at world 1 and 2
trains bit for bit as the uninterrupted one."""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_finetune_data import _varied_chats, write_jsonl  # noqa: E402

from infinity.data.batches import SHIPPED_PATH, Batches, byte_tokens, load_tokens, split  # noqa: E402
from infinity.data.samples import load_samples  # noqa: E402
from infinity.data.shards import smallest_dtype  # noqa: E402
from infinity.data.tokenized import _cached_samples, corpus_tokens, job_batches  # noqa: E402
from infinity.job.spec import load_job  # noqa: E402

KJV = gzip.decompress(SHIPPED_PATH.read_bytes())


def test_the_smallest_dtype_holds_the_vocabulary():
    assert [smallest_dtype(v) for v in (256, 257, 65536, 65537, 152064)] == \
        [np.uint8, np.uint16, np.uint16, np.uint32, np.uint32]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_ids_are_the_tokenizers_own_from_this_process_or_a_pool(tmp_path, llama, workers):
    """A text corpus cut into chunks at line ends (several chunks here) and tokenized by a pool of 2 or in this
    process: the tokenizer's ids of each line, end to end (the reference: the tokenizer called on the lines),
    stored as uint16 (a vocabulary of ~300); completion records: load_samples's samples."""
    from infinity.data import shards
    path, tok = llama
    text = tmp_path / "k.txt"
    text.write_bytes(KJV[:60_000])
    job = load_job(None, [f"model.pretrained={path}", f"data.path={text}", "model.seq_len=32"])
    old = shards.CHUNK_BYTES
    shards.CHUNK_BYTES = 8192
    try:
        ids = corpus_tokens(job, workers=workers)
    finally:
        shards.CHUNK_BYTES = old
    want = [t for row in tok(KJV[:60_000].decode().splitlines(keepends=True), add_special_tokens=False)["input_ids"]
            for t in row]
    assert ids.dtype == np.uint16 and isinstance(ids, np.memmap)
    assert ids.tolist() == want
    f = write_jsonl(tmp_path / "c.jsonl", list(_varied_chats(40)))
    chat = load_job(None, [f"model.pretrained={path}", f"data.path={f}", "data.format=chat", "model.seq_len=32"])
    got = _cached_samples(chat, tok, str(path), str(f), workers=workers)
    fresh = load_samples(chat.data, tok, str(path), 32)
    assert [(s.ids, s.labels) for s in got] == [(s.ids, s.labels) for s in fresh]


def test_byte_tokens_are_mapped_or_decompressed_once(tmp_path):
    """Bytes: a plain file is mapped in place (uint8, no copy written); a .gz file is decompressed into a shard
    beside it; both equal the bytes read whole (load_tokens), and their batches are the same."""
    plain, packed = tmp_path / "k.txt", tmp_path / "k.txt.gz"
    plain.write_bytes(KJV[:300_000])
    packed.write_bytes(gzip.compress(KJV[:300_000]))
    a, b = byte_tokens(str(plain)), byte_tokens(str(packed))
    assert a.dtype == b.dtype == np.uint8 and str(a.filename) == str(plain)
    assert not (tmp_path / ".infinity-tokens" / "k.txt").exists()
    assert [p.name.split(".")[:3] for p in (tmp_path / ".infinity-tokens").iterdir()] == [["k", "txt", "gz"]]
    whole = load_tokens(str(plain))
    assert bytes(a) == bytes(b) == bytes(whole.numpy())
    mapped = Batches(*split(a, 0.05, 32), seq_len=32, global_batch=4, seed=3)
    read = Batches(*split(whole, 0.05, 32), seq_len=32, global_batch=4, seed=3)
    for step in range(3):
        for got, want in zip(mapped.global_batch_at(step, 0), read.global_batch_at(step, 0)):
            assert torch.equal(got, want) and got.dtype == torch.long


def _shard(tmp_path):
    (found,) = [p for p in (tmp_path / ".infinity-tokens").iterdir() if p.name.endswith(".shard")]
    return found


DAMAGE = {
    "truncated ids": (lambda s: (s / "ids.bin").write_bytes((s / "ids.bin").read_bytes()[:-7]), "ids.bin has"),
    "no meta": (lambda s: (s / "meta.json").unlink(), "meta.json is missing or unreadable"),
    "bad meta": (lambda s: (s / "meta.json").write_text("{\"tok"), "meta.json is missing or unreadable"),
    "no mask": (lambda s: (s / "mask.bin").unlink(), "mask.bin is missing"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_cache_is_said_and_made_again(tmp_path, llama, capsys, kind):
    """A shard that is not whole is named with what is wrong, tokenized again (the same samples) and replaced; a
    partial one (a writer killed before its rename: `.tmp-<pid>`) is not read."""
    path, tok = llama
    f = write_jsonl(tmp_path / "c.jsonl", list(_varied_chats(12)))
    job = load_job(None, [f"model.pretrained={path}", f"data.path={f}", "data.format=chat", "model.seq_len=32"])
    first = [(s.ids, s.labels) for s in _cached_samples(job, tok, str(path), str(f))]
    shard = _shard(tmp_path)
    shutil.copytree(shard, shard.with_name(shard.name + ".tmp-99999"))  # a partial write: never read
    how, says = DAMAGE[kind]
    how(shard)
    capsys.readouterr()
    again = [(s.ids, s.labels) for s in _cached_samples(job, tok, str(path), str(f))]
    err = capsys.readouterr().err
    assert f"the token cache {shard} is damaged" in err and says in err and "tokenizing" in err, err
    assert again == first
    assert json.loads((shard / "meta.json").read_text())["samples"] == len(first)
    capsys.readouterr()
    _cached_samples(job, tok, str(path), str(f))
    assert "damaged" not in capsys.readouterr().err  # made whole


def test_the_batches_ahead_are_the_loops_own_and_raise_where_they_fail(tmp_path, llama):
    """Note [batches ahead]: from any start step (a resume), at world 1 and each rank of world 2, the windows
    taken from the thread equal batches.window's; with the masks built ahead (CPU) the masked loss is the same;
    an error on the thread is raised by the step that needed it."""
    from infinity.data.ahead import BatchesAhead
    from infinity.data.samples import attention_inputs
    path, _ = llama
    f = write_jsonl(tmp_path / "c.jsonl", list(_varied_chats(30)))
    args = [f"model.pretrained={path}", f"data.path={f}", "data.format=chat", "data.packing=true",
            "model.seq_len=32", "run.batch_size=4"]
    for world in (1, 2):
        for rank in range(world):
            batches = job_batches(load_job(None, args), rank, world)
            ahead = BatchesAhead(batches, 3, 7, 2, torch.device("cpu"))
            try:
                for step in range(3, 7):
                    rows, items = ahead.window(step)
                    want, want_items = batches.window(step, 2)
                    assert items == want_items
                    for (x, y), (wx, wy) in zip(rows, want):
                        assert torch.equal(y, wy)
                        built = attention_inputs(wx, batches.dtype)
                        assert set(x) == set(built) and all(torch.equal(x[k], built[k]) for k in x)
            finally:
                ahead.close()

    class Failing:
        def window(self, step, accum):
            if step == 2:
                raise ValueError("step 2 cannot be read")
            return [(torch.zeros(1), torch.zeros(1))], 1
    ahead = BatchesAhead(Failing(), 0, 5, 1, torch.device("meta"))
    try:
        ahead.window(0), ahead.window(1)
        with pytest.raises(ValueError, match="step 2 cannot be read"):
            ahead.window(2)
    finally:
        ahead.close()


TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0", "optimizer.total_steps=6", "optimizer.warmup_steps=2",
        "profile.enabled=false"]


def _train(rank, world, root, name, steps, data, resume=False):
    from infinity.job.resume import load_resume
    from infinity.job.train import train
    if resume:
        job, at = load_resume(root / name, None, [f"run.steps={steps}"])
        train(job, verbose=False, resume=at)
    else:
        train(load_job(None, TINY + [f"data.path={data}", f"run.dir={root}", f"run.name={name}",
                                     f"run.steps={steps}"]), verbose=False)
    return [json.loads(line)["loss"] for line in (root / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])  # (world 2: 42 s, 3 gloo runs)
def test_a_resumed_run_on_a_gz_shard_trains_as_the_uninterrupted_one(tmp_path, world, monkeypatch):
    """The data position is the step (Note [resume]); the batches come from the memory-mapped shard of a .gz
    corpus, built ahead: stopped at step 3 and resumed to 6, at world 1 and 2 (gloo), the losses and the final
    checkpoint's bytes equal the run that did not stop."""
    from infinity.job import train as train_module
    monkeypatch.setattr(train_module, "run_estimate", lambda *a: None)  # (the estimate's probe: not tested here)
    data = tmp_path / "k.txt.gz"
    data.write_bytes(gzip.compress(KJV[:200_000]))
    if world == 1:
        whole = _train(0, 1, tmp_path, "whole", 6, data)
        _train(0, 1, tmp_path, "cut", 3, data)
        resumed = _train(0, 1, tmp_path, "cut", 6, data, resume=True)
    else:
        from dist_utils import run_distributed
        whole = run_distributed(_train, 2, tmp_path, "whole", 6, data)[0]
        run_distributed(_train, 2, tmp_path, "cut", 3, data)
        resumed = run_distributed(_train, 2, tmp_path, "cut", 6, data, True)[0]
    assert len(whole) == 6 and resumed == whole
    for r in range(world):
        name = f"rank{r:05d}.bin"
        assert (tmp_path / "whole" / "checkpoint" / name).read_bytes() == \
            (tmp_path / "cut" / "checkpoint" / name).read_bytes()


def test_data_prepare_makes_the_shards_the_run_reads(tmp_path, llama, capsys, monkeypatch):
    """`infinity data prepare PATH --tokenizer DIR` with the run's settings tokenizes once: the run's
    job_batches then tokenizes nothing; without a tokenizer, chat records are refused naming what is missing."""
    from infinity.data import samples as samples_module
    from infinity.job.cli import main
    path, _ = llama
    f = write_jsonl(tmp_path / "c.jsonl", list(_varied_chats(12)))
    assert main(["data", "prepare", str(f), "--tokenizer", str(path), "--set", "model.seq_len=32"]) == 0
    out = capsys.readouterr().out
    assert "holds chat records" in out and "12 samples" in out and str(_shard(tmp_path)) in out, out
    calls = []
    monkeypatch.setattr(samples_module, "render_sample", lambda *a, **k: calls.append(a))
    job_batches(load_job(None, [f"model.pretrained={path}", f"data.path={f}", "model.seq_len=32"]))
    assert not calls
    assert main(["data", "prepare", str(f)]) == 2
    assert "needs a tokenizer" in capsys.readouterr().err


def _mapped_rss(path) -> int:
    """Resident bytes of this process's maps of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.parametrize("pread", [True, False])
def test_the_mapped_pages_stay_within_the_estimates_data_term(tmp_path, monkeypatch, pread):
    """Note [mapped pages], Note [data in the estimate]: 300 global batches of random windows over a 24 MiB
    corpus leave none of its map resident (/proc/self/smaps), within the estimate's "data" term; read through
    the map instead (planted), they map most of the corpus."""
    import os
    import random

    from infinity.data import shards
    from infinity.data.tokenized import resident_bytes
    if not os.path.exists("/proc/self/smaps"):
        pytest.skip("reads /proc/self/smaps")
    text = tmp_path / "big.txt"
    rng = random.Random(0)
    text.write_bytes(b"".join(rng.choice([b"in the beginning\n", b"and the earth\n", b"was without form\n"])
                              for _ in range(1_600_000)))
    job = load_job(None, [f"data.path={text}", "model.seq_len=256", "run.batch_size=16"])
    bound = resident_bytes(job, 1, 1, cuda=False)["data"]
    if not pread:
        monkeypatch.setattr(shards, "read_range", lambda *a: None)
    batches = job_batches(job)
    for step in range(300):
        batches.global_batch_at(step, 0)
    grown = _mapped_rss(text)
    assert (grown <= bound) if pread else (grown > 4 * bound), (grown >> 10, bound >> 10)


def _prepare_on_rank(rank, world, job_args):
    """(tokenizing calls of this rank, error) of the job's batches at world 2 (train.rank_batches)."""
    from infinity.config.sections import ConfigError
    from infinity.data import pool
    from infinity.job.train import rank_batches
    calls = []
    real = pool.encode_text
    pool.encode_text = lambda chunk: calls.append(len(chunk)) or real(chunk)
    try:
        batches = rank_batches(load_job(None, job_args), rank, world)
        return len(calls), None, batches.global_batch_at(0, 0)[0].tolist()
    except ConfigError as e:
        return len(calls), str(e), None


def test_rank_0_tokenizes_and_the_other_ranks_read_its_shards(tmp_path, llama):
    """At world 2 (gloo), rank 0 tokenizes the corpus and rank 1 reads the shard it wrote (no encode call),
    both with the same global batch; a data error of rank 0 is rank 1's too (no rank waits)."""
    from dist_utils import run_distributed
    path, _ = llama
    text = tmp_path / "k.txt"
    text.write_bytes(KJV[:50_000])
    args = [f"model.pretrained={path}", f"data.path={text}", "model.seq_len=32", "run.batch_size=4"]
    (c0, e0, b0), (c1, e1, b1) = run_distributed(_prepare_on_rank, 2, args)
    assert c0 > 0 and c1 == 0 and e0 is e1 is None and b0 == b1
    bad = args[:1] + [f"data.path={tmp_path / 'missing.txt'}"] + args[2:]
    (_, e0, _), (_, e1, _) = run_distributed(_prepare_on_rank, 2, bad)
    assert e0 == e1 and "no such file" in e0
