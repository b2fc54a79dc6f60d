"""The batches of `infinity train` pinned: the shipped corpus (bytes) and the chat example (examples/
finetune_chat.py's data, tokenizer and settings, packed and padded) give exactly the batches they gave before
the token shards (Note [token shards]): the digests below were taken from main at 7d6469b, before the change
(2026-11-28). A sampler, split, packing or masking that moves one token changes a digest."""

from __future__ import annotations

import hashlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def digest(batches, steps: int = 3, accum: int = 2, val: int = 2) -> str:
    h = hashlib.sha256()
    for step in range(steps):
        for micro in range(accum):
            for t in batches.global_batch_at(step, micro):
                h.update(str((t.dtype, tuple(t.shape))).encode())
                h.update(t.contiguous().numpy().tobytes())
    for x, y in batches.val_batches(val):
        h.update(x.contiguous().numpy().tobytes() + y.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


KJV = {(256, 16, 1234): "ad139eadda29c6c6", (64, 4, 7): "103fe3575dae49ee"}


@pytest.mark.parametrize("seq_len, batch, seed", list(KJV))
def test_the_shipped_corpus_gives_the_batches_it_gave(seq_len, batch, seed):
    from infinity.data.tokenized import job_batches
    from infinity.job.spec import load_job
    job = load_job(None, [f"model.seq_len={seq_len}", f"run.batch_size={batch}", f"data.seed={seed}"])
    got = digest(job_batches(job))
    assert got == KJV[(seq_len, batch, seed)], got


CHAT = {True: "beb7afaf3abe6ef8", False: "969077a0c798fc89"}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("finetune_chat", ROOT / "examples" / "finetune_chat.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    where = tmp_path_factory.mktemp("chat") / "pretrained"
    example.make_pretrained(str(where))
    return where, example.DATA


@pytest.mark.parametrize("packing", [True, False])
def test_the_chat_example_gives_the_batches_it_gave(chat_model, tmp_path, packing):
    import shutil

    from infinity.data.tokenized import job_batches
    from infinity.job.spec import load_job
    where, data = chat_model
    own = tmp_path / "chat_sums.jsonl"  # (a copy: the cache beside it stays in tmp_path)
    shutil.copy(data, own)
    job = load_job(None, [f"model.pretrained={where}", f"data.path={own}", "data.format=chat",
                          f"data.packing={str(packing).lower()}", "model.seq_len=64", "run.batch_size=8"])
    first = digest(job_batches(job))
    again = digest(job_batches(job))  # from the cache
    assert first == again == CHAT[packing], (first, again)


def test_a_text_corpus_in_the_pretrained_tokenizers_ids_gives_the_batches_it_gave(chat_model, tmp_path):
    """data.format = "text" with a pretrained tokenizer: the first 200 kB of the shipped corpus in the chat
    example's BPE ids (several 4096-line chunks of today's tokenization)."""
    import gzip

    from infinity.data.batches import SHIPPED_PATH
    from infinity.data.tokenized import job_batches
    from infinity.job.spec import load_job
    where, _ = chat_model
    text = tmp_path / "kjv200k.txt"
    text.write_bytes(gzip.decompress(SHIPPED_PATH.read_bytes())[:200_000])
    job = load_job(None, [f"model.pretrained={where}", f"data.path={text}", "model.seq_len=64", "run.batch_size=4"])
    first = digest(job_batches(job))
    again = digest(job_batches(job))
    assert first == again == TEXT_BPE, (first, again)


TEXT_BPE = "747ceb035d109e98"
