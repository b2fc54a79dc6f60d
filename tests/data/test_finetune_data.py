"""Fine-tuning data (records.py): completion / chat records, their masked loss against transformers', packed
rows whose samples never meet, truncation, bad data named by line, and `infinity train` on a JSONL file
(Note [masked fine-tuning loss], Note [packed samples never meet])."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from infinity.config.job import DataConfig  # noqa: E402
from infinity.config.options import ConfigError  # noqa: E402
from infinity.data.samples import (  # noqa: E402
    IGNORE,
    DataError,
    Sample,
    SampleBatches,
    attention_inputs,
    collate,
    load_samples,
    masked_loss,
)

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIALS = ["</s>", "<|system|>", "<|user|>", "<|assistant|>"]
TEXT = ("What is two plus two? Four. Name a colour: red, green, blue. The stone is grey and the sky is blue. "
        "Question answer user assistant system prompt completion. ") * 20


def make_tokenizer(chat: bool = True):
    """A byte-level BPE tokenizer trained here (no download), EOS </s>, with a chat template if `chat`."""
    from hf_tiny import bpe_tokenizer
    out = bpe_tokenizer([TEXT], specials=SPECIALS)
    if chat:
        out.chat_template = TEMPLATE
    return out


def make_llama(path, chat: bool = True, attn: str = "sdpa"):
    torch.manual_seed(0)
    tok = make_tokenizer(chat)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                                   eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=None)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model.eval(), tok


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    model, tok = make_llama(path)
    return path, model, tok


CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "two plus two?"},
                     {"role": "assistant", "content": "Four."}, {"role": "user", "content": "a colour?"},
                     {"role": "assistant", "content": "blue"}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def data(**kw) -> DataConfig:
    return DataConfig(**kw)


def test_chat_labels_cover_exactly_the_assistant_turns(tmp_path, llama):
    _, _, tok = llama
    f = write_jsonl(tmp_path / "c.jsonl", [CHAT])
    (s,) = load_samples(data(path=str(f), format="chat"), tok, "t", 128)
    assert s.ids == tok.apply_chat_template(CHAT["messages"], tokenize=True, return_dict=False)
    trained = tok.decode([t for t in s.labels if t != IGNORE])
    assert trained == "Four.</s>blue</s>"  # the turns and their EOS, nothing of the prompts or role markers
    (full,) = load_samples(data(path=str(f), format="chat", train_on_prompt=True), tok, "t", 128)
    assert full.labels == full.ids


def test_chat_masked_loss_equals_transformers(tmp_path, llama):
    _, model, tok = llama
    f = write_jsonl(tmp_path / "c.jsonl", [CHAT, {"messages": CHAT["messages"][1:3]}])
    samples = load_samples(data(path=str(f), format="chat"), tok, "t", 128)
    x, y = collate([[s] for s in samples], max(len(s.ids) for s in samples) - 1)
    ours = masked_loss(torch.float32)(model, x, y)
    # transformers' own: the padded batch with labels -100 on pads and prompts, a 2D padding mask
    width = max(len(s.ids) for s in samples)
    ids = torch.tensor([s.ids + [0] * (width - len(s.ids)) for s in samples])
    labels = torch.tensor([s.labels + [IGNORE] * (width - len(s.ids)) for s in samples])
    mask = torch.tensor([[1] * len(s.ids) + [0] * (width - len(s.ids)) for s in samples])
    ref = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])  # gpt2: absolute positions, so position ids must restart
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_alone(tmp_path, llama, attn, kind):
    path, _, tok = llama
    if kind == "llama":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()
    else:
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64)
        cfg._attn_implementation = attn
        model = transformers.GPT2LMHeadModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    samples = [Sample(ids := torch.randint(0, len(tok), (n,), generator=g).tolist(), ids) for n in (7, 12, 5)]
    x, y = collate([samples], 30)  # one row: 7 + 12 + 5 tokens, then 6 pads
    with torch.no_grad():
        packed = model(**attention_inputs(x, torch.float32)).logits[0]
        at = 0
        for s in samples:
            alone = model(input_ids=torch.tensor([s.ids])).logits[0]
            torch.testing.assert_close(packed[at:at + len(s.ids)], alone, rtol=1e-5, atol=1e-5)
            at += len(s.ids)
    # and the last token of a sample is not scored against the next sample's first
    assert y[0, 6] == IGNORE and y[0, 18] == IGNORE and y[0, 5] == samples[0].ids[6]


def test_packing_fills_rows_and_batches_are_deterministic(tmp_path, llama):
    _, _, tok = llama
    samples = [Sample(list(range(1, n + 1)), list(range(1, n + 1))) for n in (5, 9, 4, 7, 6, 3)]
    b = SampleBatches(samples, samples, seq_len=16, global_batch=2, seed=3, packing=True, dtype=torch.float32)
    x, y = b.global_batch_at(4, 1)
    assert x.shape == (2, 2, 16) and int(x[:, 1].max()) >= 2  # rows hold several samples
    assert torch.equal(x, b.global_batch_at(4, 1)[0]) and torch.equal(y, b.global_batch_at(4, 1)[1])
    # two ranks together see the one-rank global batch
    halves = [SampleBatches(samples, samples, seq_len=16, global_batch=2, seed=3, packing=True,
                            dtype=torch.float32, rank=r, world=2).batch(4, 1)[0] for r in range(2)]
    assert torch.equal(torch.cat(halves), x)
    padded = SampleBatches(samples, samples, seq_len=16, global_batch=4, seed=3, packing=False, dtype=torch.float32)
    px, py = padded.batch(0, 0)
    assert int(px[:, 1].max()) == 1 and px.shape[-1] <= 8  # one sample a row, padded to the longest
    assert ((px[:, 1] == 0) <= (py == IGNORE)).all()  # pads are never scored


def test_completion_masking_and_eos(tmp_path, llama):
    _, _, tok = llama
    f = write_jsonl(tmp_path / "p.jsonl", [{"q": "two plus two?", "a": " Four."}])
    d = data(path=str(f), format="completion", prompt_field="q", completion_field="a")
    (s,) = load_samples(d, tok, "t", 128)
    prompt = tok("two plus two?", add_special_tokens=False)["input_ids"]
    assert s.ids[:len(prompt)] == prompt and s.ids[-1] == tok.eos_token_id
    assert s.labels[:len(prompt)] == [IGNORE] * len(prompt)
    assert tok.decode(s.labels[len(prompt):]) == " Four.</s>"


def test_truncation_right_or_refuse(tmp_path, llama):
    _, _, tok = llama
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "two plus two? " * 10, "completion": " Four."}])
    (s,) = load_samples(data(path=str(f), format="completion", train_on_prompt=True), tok, "t", 8)
    assert len(s.ids) == 9
    with pytest.raises(DataError, match=r"p.jsonl line 1: .*tokens.*data.truncation"):
        load_samples(data(path=str(f), format="completion", truncation="refuse"), tok, "t", 8)


@pytest.mark.parametrize("content, match", [
    (b'{"prompt": "a", "completion": "b"}\n\xff\xfe\x00binary\n', r"x.jsonl line 2: not UTF-8"),
    (b'{"prompt": "a", "completion": "b"}\n{"prompt": "a", \n', r"x.jsonl line 2: not JSON"),
    (b'{"prompt": "a", "completion": "b"}\n\n{"prompt": "a"}\n', r"x.jsonl line 3: no field 'completion'.*"
                                                                 r"data.completion_field"),
])
def test_bad_completion_data_names_the_line(tmp_path, llama, content, match):
    _, _, tok = llama
    (tmp_path / "x.jsonl").write_bytes(content)
    with pytest.raises(DataError, match=match):
        load_samples(data(path=str(tmp_path / "x.jsonl"), format="completion"), tok, "t", 64)


def test_a_json_array_record_without_the_field_says_no_field_as_jsonl_does(tmp_path, llama):
    """A .json file (one JSON array, read by datasets: a record lacking a column gets None there) names the
    missing field as a .jsonl file does, not as a NoneType value."""
    pytest.importorskip("datasets")
    _, _, tok = llama
    records = [{"prompt": "a", "completion": " b"}] * 5 + [{"prompt": "c"}]
    (tmp_path / "x.json").write_text(json.dumps(records))
    with pytest.raises(DataError, match=r"x.json record 6: no field 'completion' \(it has \['prompt'\]\); add it, or "
                                        r"set data.completion_field"):
        load_samples(data(path=str(tmp_path / "x.json"), format="completion"), tok, "t", 64)


def test_missing_data_files_name_the_key_that_set_them(tmp_path, llama):
    from infinity.job.spec import load_job
    from infinity.job.train import job_batches
    path, _, _ = llama
    train_f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{i} plus 1?", "completion": f" {i + 1}."}
                                                  for i in range(10)])
    common = [f"model.pretrained={path}", "data.format=completion", "model.seq_len=32", "run.batch_size=2",
              f"run.dir={tmp_path}"]
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "notes.txt").write_text("not records\n")
    for sets, needle in (([f"data.path={train_f}", f"data.val_path={tmp_path / 'nope.jsonl'}"],
                          f"data.val_path = '{tmp_path / 'nope.jsonl'}': no such file"),
                         ([f"data.path={empty}"], f"data.path = '{empty}' is a directory with no file in it"),
                         ([f"data.path={train_f}", f"data.val_path={tmp_path}"],
                          f"data.val_path = '{tmp_path}' holds both text ({tmp_path / 'notes.txt'}) and record "
                          f"files ({train_f})"),
                         ([f"data.path={train_f}", f"data.val_path={tmp_path / 'v*.jsonl'}"],
                          f"data.val_path = '{tmp_path / 'v*.jsonl'}' matches no file")):
        with pytest.raises(ConfigError) as e:
            job_batches(load_job(None, common + sets))
        assert needle in str(e.value)


def test_bad_chat_data_names_the_line(tmp_path, llama):
    _, _, tok = llama
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}
    f = write_jsonl(tmp_path / "c.jsonl", [CHAT, bad])
    with pytest.raises(DataError, match=r"c.jsonl line 2: message 1 has role 'robot'"):
        load_samples(data(path=str(f), format="chat"), tok, "t", 128)
    with pytest.raises(ConfigError, match="no chat template"):
        load_samples(data(path=str(f), format="chat"), make_tokenizer(chat=False), "DIR", 128)


def test_parquet_read_with_datasets(tmp_path, llama):
    datasets = pytest.importorskip("datasets")
    _, _, tok = llama
    datasets.Dataset.from_list([{"prompt": "a", "completion": " b"}] * 3).to_parquet(str(tmp_path / "d.parquet"))
    samples = load_samples(data(path=str(tmp_path / "d.parquet"), format="completion"), tok, "t", 64)
    assert len(samples) == 3


def _sums(n: int):
    g = torch.Generator().manual_seed(n)
    for _ in range(n):
        a, b = torch.randint(0, 10, (2,), generator=g).tolist()
        yield {"prompt": f"{a} plus {b}?", "completion": f" {a + b}."}


@pytest.mark.slow  # ~40 s on 2 shared cores
def test_train_completion_jsonl_learns_the_format_not_the_json(tmp_path, llama):
    """`infinity train` on a JSONL file: the export continues a prompt with a completion and stops (EOS), where
    training the file as text would continue it with JSON (issue 31)."""
    from infinity.job.spec import load_job
    from infinity.job.train import train
    path, _, tok = llama
    f = write_jsonl(tmp_path / "sums.jsonl", list(_sums(200)))
    job = load_job(None, [f"model.pretrained={path}", f"data.path={f}", "data.format=completion", "data.packing=true",
                          "model.seq_len=64", "run.batch_size=8", "run.steps=120", "run.eval_every=0",
                          "run.eval_batches=1", "optimizer.lr=1e-2", "optimizer.warmup_steps=10",
                          f"run.dir={tmp_path}", "run.name=r"])
    result = train(job, verbose=False)
    assert result.val_loss < 1.0
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < m["tokens_per_step"] < 8 * 64 for m in metrics)  # only completion tokens are counted
    model = transformers.AutoModelForCausalLM.from_pretrained(result.run_dir / "export").eval()
    ids = tok("3 plus 4?", return_tensors="pt")["input_ids"]
    out = tok.decode(model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:])
    assert out.startswith(" ") and out.rstrip().endswith("</s>") and "prompt" not in out and "{" not in out, out


@pytest.mark.slow  # ~25 s: engine start
def test_train_chat_padded_runs_and_counts_tokens(tmp_path, llama):
    from infinity.job.spec import load_job
    from infinity.job.train import train
    path, _, tok = llama
    f = write_jsonl(tmp_path / "c.jsonl", [CHAT] * 6)
    job = load_job(None, [f"model.pretrained={path}", f"data.path={f}", "data.format=chat", "model.seq_len=64",
                          "run.batch_size=2", "run.steps=2", "run.eval_every=0", "run.eval_batches=1",
                          "run.export=false", f"run.dir={tmp_path}", "run.name=r"])
    result = train(job, verbose=False)
    (sample,) = load_samples(data(path=str(f), format="chat"), tok, "t", 64)[:1]
    trained = sum(t != IGNORE for t in sample.labels[1:])
    metrics = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["tokens_per_step"] for m in metrics] == [2 * trained] * 2
    summary = json.loads((result.run_dir / "summary.json").read_text())
    assert summary["trained_tokens_per_step"] == 2 * trained


def test_finetune_defaults_printed_and_overridable(tmp_path, llama):
    from infinity.job.finetune_defaults import pretrained_defaults
    from infinity.job.spec import load_job
    path, _, _ = llama
    base = [f"model.pretrained={path}", f"run.dir={tmp_path}"]
    cfg = load_job(None, base).engine_config(str(tmp_path))
    assert cfg.optimizer.lr == 2e-5 and cfg.optimizer.no_decay == ("bias_and_norm",)
    assert cfg.optimizer.weight_decay == 0.1  # the section's weight decay is kept for the other weights
    assert load_job(None, base + ["model.lora.r=4"]).engine_config(str(tmp_path)).optimizer.lr == 2e-4
    mine = load_job(None, base + ["optimizer.lr=1e-3", "optimizer.no_decay=[]"]).engine_config(str(tmp_path))
    assert mine.optimizer.lr == 1e-3 and mine.optimizer.no_decay == ()
    assert load_job(None, [f"run.dir={tmp_path}"]).engine_config(str(tmp_path)).optimizer.lr == 2e-3  # scratch
    lines = [d.line() for d in load_job(None, base).defaults()]
    assert any("optimizer.lr = 2e-05" in line and "--set optimizer.lr=" in line for line in lines)
    # the checkpoint's dtype: bf16 kept, fp16 -> fp32 on CPU (said why), fp16 on CUDA
    config = json.loads((path / "config.json").read_text())
    for dtype, cuda, want in (("bfloat16", False, "bf16"), ("float16", False, "fp32"), ("float16", True, "fp16"),
                              ("float32", False, None)):
        d = tmp_path / f"{dtype}{cuda}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**config, "dtype": dtype}))
        got = {x.key: x for x in pretrained_defaults(str(d), 0, {}, cuda=cuda)}
        assert (got["compute_dtype"].value if "compute_dtype" in got else None) == want
    assert "CPU" in got.get("compute_dtype", pretrained_defaults(str(tmp_path / "float16False"), 0, {},
                                                                  cuda=False)[-1]).why
    assert not pretrained_defaults(str(tmp_path / "bfloat16False"), 0, {"precision": {"compute_dtype": "fp32"}},
                                   cuda=False)[2:]


def test_binary_text_data_names_the_line(tmp_path):
    from infinity.data.batches import load_tokens
    (tmp_path / "t.txt").write_bytes(b"one\ntwo\nthr\xffee\n")
    with pytest.raises(ConfigError, match=r"t.txt' line 3: not UTF-8"):
        load_tokens(str(tmp_path / "t.txt"))
    assert len(load_tokens("kjv")) > 1_000_000  # the shipped corpus is UTF-8


def test_text_in_another_encoding_gets_the_conversion_and_binary_data_does_not(tmp_path):
    """A Latin-1 file is text in another encoding (the message gives the iconv line); bytes with NULs and control
    bytes look binary. Both name the line and the byte, for plain text and for JSONL records."""
    from infinity.data.batches import load_tokens
    from infinity.data.samples import read_records
    latin = tmp_path / "notes.txt"
    latin.write_bytes("Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9.\n".encode("latin-1") * 200)
    with pytest.raises(ConfigError, match=r"notes.txt' line 1: not UTF-8 .*another encoding.*iconv -f latin1 -t utf-8 "
                                          r".*notes.txt > utf8.txt"):
        load_tokens(str(latin))
    binary = tmp_path / "blob.txt"
    binary.write_bytes(bytes(range(256)) * 40)
    with pytest.raises(ConfigError, match=r"blob.txt' line 2: not UTF-8 .*looks binary") as e:
        load_tokens(str(binary))
    assert "iconv" not in str(e.value)
    records = tmp_path / "r.jsonl"
    records.write_bytes('{"prompt": "caf\u00e9", "completion": "cr\u00e8me"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"r.jsonl line 1: not UTF-8 .*another encoding.*iconv"):
        read_records(str(records))


def test_validation_file_or_fraction(tmp_path, llama):
    from infinity.job.spec import load_job
    from infinity.job.train import job_batches
    path, _, tok = llama
    train_f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"{i} plus 1?", "completion": f" {i + 1}."}
                                                  for i in range(10)])
    val_f = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "7 plus 7?", "completion": " 14."}])
    common = [f"model.pretrained={path}", f"data.path={train_f}", "data.format=completion", "model.seq_len=32",
              "run.batch_size=2", f"run.dir={tmp_path}"]
    own = job_batches(load_job(None, common + [f"data.val_path={val_f}"]))
    assert len(own.train) == 10 and [s.ids for s in own.val] == \
        [s.ids for s in load_samples(data(path=str(val_f), format="completion"), tok, "t", 32)]
    x, y = own.val_batches(1)[0]
    assert tok.decode([t for t in y.flatten().tolist() if t != IGNORE]).count(" 14.</s>") == 2  # masked alike
    split = job_batches(load_job(None, common + ["data.val_fraction=0.2"]))
    assert (len(split.train), len(split.val)) == (8, 2)


def test_records_under_the_text_format_are_read_as_what_they_are_or_refused(tmp_path, llama):
    """Note [data format from the records]: chat / completion JSONL under the default data.format = "text" gives
    the batches of the format said explicitly, and a line saying so; records without a text field
    (data.text_field: Note [text records]), or a format the records do not have, are refused naming the key
    (never trained on as JSON text)."""
    from infinity.data.tokenized import job_batches, resolve_data_format
    from infinity.job.spec import load_job
    path, _, _ = llama
    chat = write_jsonl(tmp_path / "c.jsonl", [CHAT] * 4)
    sums = write_jsonl(tmp_path / "s.jsonl", list(_sums(6)))
    common = [f"model.pretrained={path}", "model.seq_len=64", "run.batch_size=2", f"run.dir={tmp_path}"]
    for f, kind in ((chat, "chat"), (sums, "completion")):
        job = load_job(None, common + [f"data.path={f}"])
        resolved, said = resolve_data_format(job)
        assert resolved.data.format == kind and f'data.format = "{kind}"' in said and str(f) in said
        explicit = job_batches(load_job(None, common + [f"data.path={f}", f"data.format={kind}"]))
        for got, want in zip(job_batches(job).batch(0, 0), explicit.batch(0, 0)):
            assert torch.equal(got, want)
    titles = write_jsonl(tmp_path / "t.jsonl", [{"title": "hello"}] * 4)
    with pytest.raises(ConfigError, match=r"fields \['title'\], none of them data.text_field = 'text'.*: "
                                          r"set data.text_field"):
        job_batches(load_job(None, common + [f"data.path={titles}"]))
    with pytest.raises(ConfigError, match=r'data.format = "completion" but .*c.jsonl line 1 is a chat record.*'
                                          r'set data.format = "chat"'):
        job_batches(load_job(None, common + [f"data.path={chat}", "data.format=completion"]))
    plain = tmp_path / "p.txt"
    plain.write_text("In the beginning {was} the word.\n" * 50)
    assert resolve_data_format(load_job(None, common + [f"data.path={plain}"]))[1] is None
    for sets in (["data.format=text"], []):  # explicit, on the command line or in a job file: obeyed, not overridden
        job_file = tmp_path / "job.toml"
        job_file.write_text('[data]\nformat = "text"\n')
        with pytest.raises(ConfigError, match=r'data.format = "text" is set, but .*c.jsonl.* holds chat records.*'
                                              r'set data.format = "chat"'):
            resolve_data_format(load_job(None if sets else job_file, common + [f"data.path={chat}", *sets]))
    assert resolve_data_format(load_job(None, common + [f"data.path={plain}", "data.format=text"]))[1] is None


def test_tokenized_data_is_cached_beside_the_data_and_made_again_when_it_changes(tmp_path, llama, monkeypatch):
    """Note [tokenized data cache]: the second start reads the samples (and a text corpus's ids) from the cache
    beside the data, equal to tokenizing afresh; a changed data file or tokenizer file tokenizes again."""
    import shutil

    from infinity.data import samples as samples_module
    from infinity.data.tokenized import corpus_tokens, job_batches
    from infinity.job.spec import load_job
    path, _, tok = llama
    own = tmp_path / "model"
    shutil.copytree(path, own)
    f = write_jsonl(tmp_path / "s.jsonl", list(_sums(8)))
    job = load_job(None, [f"model.pretrained={own}", f"data.path={f}", "data.format=completion", "model.seq_len=32",
                          "run.batch_size=2", f"run.dir={tmp_path}"])
    fresh = load_samples(job.data, tok, "t", 32)
    first = job_batches(job)
    assert list((tmp_path / ".infinity-tokens").iterdir())
    calls = []
    real = samples_module.render_sample
    monkeypatch.setattr(samples_module, "render_sample", lambda *a, **k: calls.append(a) or real(*a, **k))
    again = job_batches(job)
    assert not calls, "the second start tokenized again"
    assert [(s.ids, s.labels) for s in [*again.train, *again.val]] == [(s.ids, s.labels) for s in fresh] == \
        [(s.ids, s.labels) for s in [*first.train, *first.val]]
    write_jsonl(f, list(_sums(9)))  # the data changed
    job_batches(job)
    assert len(calls) == 9  # (one per record)
    config = json.loads((own / "tokenizer_config.json").read_text())  # the tokenizer changed
    (own / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|user|>"}))
    changed = job_batches(job)
    assert len(calls) == 18 and changed.train[0].ids[-1] != again.train[0].ids[-1]  # another EOS
    # a text corpus: the ids of the tokenizer, cached
    corpus = tmp_path / "c.txt"
    corpus.write_text("two plus two is four.\n" * 40)
    text = load_job(None, [f"model.pretrained={path}", f"data.path={corpus}", "model.seq_len=16"])
    ids = corpus_tokens(text)
    assert ids.tolist() == tok("two plus two is four.\n" * 40, add_special_tokens=False)["input_ids"]
    assert any(p.name.startswith("c.txt.") for p in (tmp_path / ".infinity-tokens").iterdir())
    assert corpus_tokens(text).tolist() == ids.tolist()


def _varied_chats(n):
    """Chat records of different lengths: unequal label-token counts per row and per micro-batch."""
    words = ["two", "plus", "blue", "red", "the", "stone", "is", "grey", "sky", "green"]
    for i in range(n):
        say = " ".join(words[(i + k) % len(words)] for k in range(1 + 3 * (i % 4)))
        yield {"messages": [{"role": "user", "content": words[i % 10] + "?" * (i % 3)},
                            {"role": "assistant", "content": say}]}


def test_the_jobs_window_is_weighted_by_its_tokens(tmp_path, llama, monkeypatch):
    """Note [token-weighted windows]: `infinity train` on chat records of unequal lengths, accumulation 3: each
    step's loss and grad norm are those of plain PyTorch on the window's three micro-batches as one big batch
    (the mean over all its trained tokens), and the second step's loss follows its AdamW update; the window's
    items over two ranks' rows are the same count."""
    from infinity.data.tokenized import job_batches
    from infinity.job import train as train_module
    from infinity.job.spec import load_job
    from infinity.job.train import train
    from infinity.optim.schedule import lr_at
    monkeypatch.setattr(train_module, "run_estimate", lambda *a: None)  # (the estimate's RSS probe: not tested here)
    path, _, _ = llama
    f = write_jsonl(tmp_path / "c.jsonl", list(_varied_chats(24)))
    job = load_job(None, [f"model.pretrained={path}", f"data.path={f}", "data.format=chat", "model.seq_len=48",
                          "run.batch_size=2", "run.steps=2", "run.eval_every=0", "run.eval_batches=1",
                          "run.export=false", "run.checkpoint=false", f"run.dir={tmp_path}", "run.name=r",
                          "train.grad_accum_steps=3", "optimizer.grad_clip=0", "placement.params=device",
                          "placement.grads=device", "placement.optimizer=device", "profile.enabled=false"])
    metrics = [json.loads(line) for line in (train(job, verbose=False).run_dir / "metrics.jsonl").read_text()
               .splitlines()]
    batches, o = job_batches(job), job.engine_config("x").optimizer
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    want_loss, want_norm, counts = [], [], []
    for step in range(2):
        window = [batches.global_batch_at(step, m) for m in range(3)]
        width = max(x.shape[-1] for x, _ in window)
        x = torch.cat([F.pad(x, (0, width - x.shape[-1])) for x, _ in window])  # pads: id 0, segment 0
        y = torch.cat([F.pad(y, (0, width - y.shape[-1]), value=IGNORE) for _, y in window])
        counts.append([int((y != IGNORE).sum()) for _, y in window])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o)
        loss = masked_loss(torch.float32)(model, x, y)  # the big batch's mean over its trained tokens
        loss.backward()
        want_loss.append(loss.item())
        want_norm.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert all(len(set(c)) > 1 for c in counts)  # the micro-batches' token counts differ
    assert [m["grad_norm"] for m in metrics] == pytest.approx(want_norm, rel=1e-4)
    assert [m["loss"] for m in metrics] == pytest.approx(want_loss, rel=1e-5)
    assert [m["tokens_per_step"] for m in metrics] == [sum(c) for c in counts]
    halves = [job_batches(job, rank=r, world=2).window(1, 3) for r in range(2)]
    assert halves[0][1] == halves[1][1] == sum(counts[1])
    assert [torch.cat([h[0][m][1] for h in halves]).tolist() for m in range(3)] == \
        [batches.global_batch_at(1, m)[1].tolist() for m in range(3)]
