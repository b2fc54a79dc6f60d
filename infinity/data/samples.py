"""Fine-tuning data of `infinity train`: prompt/completion and chat records, masked, padded or packed.

`data.format = "completion"` reads `{"prompt": ..., "completion": ...}` records and `"chat"` reads
`{"messages": [{"role": ..., "content": ...}]}` records (field names from `data.*_field`) from a local .jsonl,
.json, .parquet or .arrow file. Each record becomes one sample: token ids and labels (the ids themselves where
the loss counts, -100 elsewhere).

Note [masked fine-tuning loss]: a sample's loss is exactly what transformers computes for
`model(input_ids, labels=labels).loss`: the logits at position t are scored against labels[t + 1], tokens
labelled -100 are left out, and the loss is the mean over the remaining tokens of the whole batch. Labels are
-100 on the prompt (completion) or on every turn but the assistant's (chat) unless `data.train_on_prompt`. A
completion is tokenized as the tokenizer's BOS (when it defines one and adds it) + prompt + completion + EOS,
so the model learns to stop. A chat is rendered by the tokenizer's own `apply_chat_template`; the assistant
turns are found by rendering each prefix of the conversation (with the generation prompt before an assistant
turn) and taking the token boundaries, so any template works, and an EOS is appended after a final assistant
turn the template does not end with one.

Note [packed samples never meet]: with `data.packing = true` several samples share a row of model.seq_len
tokens; the row carries a segment id per token (1, 2, ... per sample, 0 on padding) and the loss passes the
model a 4D additive attention mask that is causal *within* a segment and closed across segments, plus
position ids that restart at 0 for each sample. So a sample's logits equal its logits alone (the test checks
this with transformers' "sdpa" and "eager" attention), and the last token of a sample is not scored against
the first of the next. Without packing each row holds one sample, padded to the longest row of the global
batch; the same mask then hides the padding. Rows are drawn by (data.seed, step, micro-batch) over the whole
global batch, so Note [same batches at every world size] holds here too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from infinity.config.options import ConfigError
from infinity.data.batches import RankBatches, rank_rows
from infinity.data.sources import DataError, is_records, resolve, stream_records  # noqa: F401 - (DataError here too)
from infinity.runtime.chunked_loss import token_loss

IGNORE = -100  # transformers' ignore_index
ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    labels: list[int]  # aligned with ids (not shifted); IGNORE where the loss does not count


# ---------------------------------------------------------------- reading

def read_records(path: str, key: str = "data.path") -> list[tuple[str, dict]]:
    """(where, record) of each record of the files `path` names (Note [data of several files]); `where` is
    "FILE line N" (jsonl) or "FILE record N"; `key`: the setting that named them (data.path, data.val_path), as
    its errors name it. Held whole: the job streams them instead (`record_stream`)."""
    return list(record_stream(path, key))


def _field(record: dict, name: str, key: str, where: str, kind: type) -> Any:
    if record.get(name) is None:  # (a .json/.parquet record read by datasets has every column: None where missing)
        present = sorted(k for k, v in record.items() if v is not None)
        raise DataError(f"{where}: no field {name!r} (it has {present}); add it, or set data.{key} to "
                        f"the field's name")
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {name!r} is a {type(value).__name__}, not a "
                        f"{'string' if kind is str else 'list of messages'}")
    return value


def record_format(record: dict, data) -> str | None:
    """What a record is, by its fields (as TRL tells a conversational dataset by its records): "chat" (a list of
    messages), "completion" (a prompt and a completion), "text" (a text field), or None."""
    if isinstance(record.get(data.messages_field), list):
        return "chat"
    if data.prompt_field in record and data.completion_field in record:
        return "completion"
    if isinstance(record.get(data.text_field), str):
        return "text"
    return None


def first_record(path: str) -> tuple[str, dict] | None:
    """(where, record) of the first record of the files `path` names when they hold records (.jsonl / .json /
    .parquet / .arrow files, or text whose first line is a JSON object), else None (plain text, or files that
    cannot be read: their reading names what is wrong)."""
    try:
        found = resolve(path)
    except ConfigError:
        return None
    file = found.files[0]
    if found.records and file.suffix.lower() != ".jsonl":
        return next(stream_records(file, found.say(file)), None)
    with open(file, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    record = json.loads(raw)
                except ValueError:
                    return None
                return (f"{file} line 1", record) if isinstance(record, dict) else None
    return None


def resolve_format(data, explicit: bool = False) -> tuple[str, str | None]:
    """(data.format to read data.path with, the line that says a change). Note [data format from the records]:
    a file of records under the default "text" would train on its JSON syntax: chat or completion records are
    read as such and the start line says so; other records are refused naming data.format. A format the user
    set (`explicit`, "text" too) that the records do not have is refused naming both."""
    found = first_record(data.path)
    if found is None:
        if data.format != "text":
            return data.format, None  # read_records names what is wrong with the file
        return "text", None
    where, record = found
    kind = record_format(record, data)
    if data.format == "text":
        if kind in ("chat", "completion") and explicit:
            raise ConfigError(f'data.format = "text" is set, but data.path = {data.path!r} holds {kind} records '
                              f'({where}: {", ".join(sorted(record))}): set data.format = "{kind}" (or remove the '
                              f"key: the records say what they are), or give a plain text file")
        if kind == "text" and resolve(data.path).records:
            return "text", None  # Note [text records]
        if kind in ("chat", "completion"):
            return kind, (f"data: {data.path} holds {kind} records ({where}: {', '.join(sorted(record))}); read as "
                          f'data.format = "{kind}" (set it in the job file to say so)')
        if kind == "text":
            raise ConfigError(f'data.path = {data.path!r} holds JSON lines with a "{data.text_field}" field in a file '
                              f'that is not .jsonl, and data.format = "text" would train on the JSON syntax: name it '
                              f"*.jsonl to train on each record's {data.text_field!r}, or give a plain text file")
        fix = ('set data.text_field to the field that holds the text, data.format = "chat" (a list of messages) or '
               '"completion" (prompt and completion fields; data.*_field names them)')
        if resolve(data.path).records:  # (Note [text records]: read by a field, never as JSON text)
            raise ConfigError(f"data.path = {data.path!r} holds records with fields {sorted(record)}, none of them "
                              f"data.text_field = {data.text_field!r} ({where}): {fix}")
        raise ConfigError(f'data.path = {data.path!r} holds JSON records with fields {sorted(record)}, and '
                          f'data.format = "text" would train on the JSON syntax: {fix}, or give a plain text file')
    if kind is not None and kind != data.format and kind != "text":
        fields = ", ".join(sorted(record))
        raise ConfigError(f'data.format = "{data.format}" but {where} is a {kind} record ({fields}): set '
                          f'data.format = "{kind}", or data.*_field to the fields that hold the {data.format}')
    return data.format, None


# ---------------------------------------------------------------- rendering

def _limit(sample: Sample, seq_len: int, truncation: str, where: str) -> Sample:
    """A sample of at most seq_len + 1 tokens (inputs and next-token targets of one row), or the error."""
    if len(sample.ids) <= seq_len + 1:
        return sample
    if truncation == "refuse":
        raise DataError(f"{where}: {len(sample.ids)} tokens, more than model.seq_len + 1 = {seq_len + 1}; raise "
                        f'model.seq_len, shorten the record, or set data.truncation = "right"')
    return Sample(sample.ids[:seq_len + 1], sample.labels[:seq_len + 1])


def render_completion(tokenizer, record: dict, data, where: str) -> Sample:
    """BOS + prompt + completion + EOS; labels only on completion + EOS unless data.train_on_prompt."""
    prompt = _field(record, data.prompt_field, "prompt_field", where, str)
    completion = _field(record, data.completion_field, "completion_field", where, str)
    bos = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    plain = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    head = bos[: len(bos) - len(plain)] if bos[len(bos) - len(plain):] == plain else []  # BOS if the tokenizer adds one
    p = head + plain
    c = tokenizer(completion, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        c = c + [tokenizer.eos_token_id]
    labels = (p if data.train_on_prompt else [IGNORE] * len(p)) + c
    return Sample(p + c, labels)


def render_chat(tokenizer, record: dict, data, where: str) -> Sample:
    """The conversation by the tokenizer's chat template; labels only on assistant turns unless
    data.train_on_prompt (Note [masked fine-tuning loss])."""
    messages = _field(record, data.messages_field, "messages_field", where, list)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise DataError(f"{where}: message {i} is not an object with a \"role\" and a string \"content\"")
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has role {m['role']!r}; use one of {list(ROLES)}")
    ids = _template(tokenizer, messages)
    mask = [bool(data.train_on_prompt)] * len(ids)
    if not data.train_on_prompt:
        start = 0
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = _template(tokenizer, messages[:i], generation_prompt=True)
            upto = _template(tokenizer, messages[:i + 1])
            start = _common(before, ids)
            end = _common(upto, ids)
            for t in range(start, end):
                mask[t] = True
    eos = tokenizer.eos_token_id
    if eos is not None and messages and messages[-1]["role"] == "assistant" and (not ids or ids[-1] != eos):
        ids, mask = ids + [eos], mask + [True]
    return Sample(ids, [t if m else IGNORE for t, m in zip(ids, mask)])


def _template(tokenizer, messages: list, generation_prompt: bool = False) -> list[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                        return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _common(prefix: list[int], ids: list[int]) -> int:
    """Length of the common prefix (the token boundary where a conversation prefix ends)."""
    n = 0
    for a, b in zip(prefix, ids):
        if a != b:
            break
        n += 1
    return n


def check_template(data, tokenizer, tokenizer_where: str) -> None:
    if data.format == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f'data.format = "chat": the tokenizer in {tokenizer_where} has no chat template; save '
                          f"one with it (tokenizer.chat_template = ...; tokenizer.save_pretrained(DIR)), or use "
                          f'data.format = "completion"')


def render_sample(tokenizer, record: dict, data, seq_len: int, where: str) -> Sample | None:
    """The sample of one record in data.format, limited to seq_len + 1 tokens; None when it has no token to
    train on (left out)."""
    render = render_chat if data.format == "chat" else render_completion
    sample = _limit(render(tokenizer, record, data, where), seq_len, data.truncation, where)
    if len(sample.ids) >= 2 and any(t != IGNORE for t in sample.labels[1:]):
        return sample
    return None


def no_samples(path: str) -> DataError:
    return DataError(f"{path}: no record has a token to train on; check data.format and the field names")


def record_files(path: str, key: str = "data.path"):
    """The record files `path` names (sources.resolve), or the ConfigError naming one that is not of records."""
    found = resolve(path, key)
    if not found.records:
        raise ConfigError(f"{found.say(found.files[0])}: data.format needs .jsonl, .json, .parquet or .arrow files; "
                          f'rename or convert it, or set data.format = "text" to train on it as plain text')
    return found


def record_stream(path: str, key: str = "data.path"):
    """(where, record) of each record of the files `path` names, in order, read as they are consumed (Note [text
    records]: never held whole)."""
    found = record_files(path, key)
    for file in found.files:
        yield from stream_records(file, found.say(file))


def load_samples(data, tokenizer, tokenizer_where: str, seq_len: int, path: str | None = None,
                 key: str = "data.path") -> list[Sample]:
    """The samples of `path` (default data.path) in data.format; `key`: the setting that named the file."""
    check_template(data, tokenizer, tokenizer_where)
    samples = []
    for where, record in record_stream(path or data.path, key):
        sample = render_sample(tokenizer, record, data, seq_len, where)
        if sample is not None:
            samples.append(sample)
    if not samples:
        raise no_samples(path or data.path)
    return samples


class SampleShard:
    """Samples read from a shard's memory maps (Note [token shards] in shards.py) as a sequence of Sample:
    sample i is built when it is read; a slice is a view."""

    def __init__(self, ids, mask, offsets, lo: int = 0, hi: int | None = None):
        self.ids, self.mask, self.offsets = ids, mask, offsets
        self.lo, self.hi = lo, len(offsets) - 1 if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            assert step == 1, "a SampleShard slices with step 1"
            return SampleShard(self.ids, self.mask, self.offsets, self.lo + start, self.lo + max(start, stop))
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        import numpy as np

        from infinity.data.shards import read_range

        def read(array, start: int, count: int) -> np.ndarray:  # from the file (Note [mapped pages])
            got = read_range(array, start, count)
            return np.asarray(array[start:start + count]) if got is None else got
        a, b = (int(v) for v in read(self.offsets, self.lo + i, 2))
        ids = read(self.ids, a, b - a).astype(np.int64)
        labels = np.where(read(self.mask, a, b - a) > 0, ids, IGNORE)
        return Sample(ids.tolist(), labels.tolist())

    def __iter__(self):
        return (self[i] for i in range(len(self)))


# ---------------------------------------------------------------- batches

def _rows(samples: list[Sample], order: list[int], count: int, seq_len: int, packing: bool) -> list[list[Sample]]:
    """`count` rows of samples taken in `order` (several per row when packing)."""
    rows: list[list[Sample]] = []
    it = iter(order)
    if not packing:
        return [[samples[next(it)]] for _ in range(count)]
    room = 0
    for i in it:
        need = min(len(samples[i].ids), seq_len)
        if need > room:
            if len(rows) == count:
                break
            rows.append([])
            room = seq_len
        rows[-1].append(samples[i])
        room -= need
    return rows


def collate(rows: list[list[Sample]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs [B, 2, width]: token ids and segment ids, targets [B, width]) of rows of samples."""
    x = torch.zeros(len(rows), 2, width, dtype=torch.long)
    y = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for s, sample in enumerate(row, 1):
            n = min(len(sample.ids), width - at)  # a lone sample of seq_len + 1 tokens: its last is only a target
            x[r, 0, at:at + n] = torch.tensor(sample.ids[:n])
            x[r, 1, at:at + n] = s
            targets = sample.labels[1:n + 1] + [IGNORE] * max(0, n + 1 - len(sample.labels))
            y[r, at:at + n] = torch.tensor(targets[:n])
            at += n
    return x, y


def attention_inputs(x: torch.Tensor, dtype: torch.dtype) -> dict:
    """input_ids, a 4D additive attention mask and position ids of collated rows (Note [packed samples never
    meet])."""
    ids, seg = x[:, 0], x[:, 1]
    t = ids.size(1)
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal & (seg[:, None, :] > 0)
    allowed |= torch.eye(t, dtype=torch.bool, device=x.device)  # a pad sees itself: no all-masked row (NaN)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=x.device).masked_fill(~allowed, torch.finfo(dtype).min)
    start = torch.ones_like(seg, dtype=torch.bool)
    start[:, 1:] = seg[:, 1:] != seg[:, :-1]
    idx = torch.arange(t, device=x.device).expand_as(seg)
    first = torch.cummax(torch.where(start, idx, torch.zeros_like(idx)), dim=1).values
    return {"input_ids": ids, "attention_mask": mask[:, None], "position_ids": idx - first}


def masked_loss(dtype: torch.dtype):
    """loss(forward, x, y, num_items=None) of collated rows: the mean cross-entropy over the targets that are not
    -100, or their sum over `num_items` (the window's items: Note [token-weighted windows])."""
    from infinity.models.build import without_cache

    def loss(forward, x, y: torch.Tensor, num_items: int | None = None) -> torch.Tensor:
        inputs = x if isinstance(x, dict) else attention_inputs(x, dtype)  # (a dict: built ahead, ahead.py)
        return token_loss(forward(**inputs, **without_cache(inputs["input_ids"])).logits, y, num_items)
    return loss


class SampleBatches(RankBatches):
    """Deterministic batches of samples for one rank (data.RankBatches: the seed of each global batch)."""

    def __init__(self, train: list[Sample], val: list[Sample], *, seq_len: int, global_batch: int, seed: int,
                 packing: bool, dtype: torch.dtype, rank: int = 0, world: int = 1):
        self.train, self.val, self.seq_len, self.seed, self.packing = train, val, seq_len, seed, packing
        self.global_batch, self.rows = global_batch, rank_rows(global_batch, rank, world)
        self.dtype, self.loss = dtype, masked_loss(dtype)

    def inputs_ahead(self, x: torch.Tensor) -> dict:
        """The model's inputs of collated rows, built ahead of the step (Note [batches ahead] in ahead.py)."""
        return attention_inputs(x, self.dtype)

    def _batch(self, samples: list[Sample], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        need = self.global_batch * (self.seq_len if self.packing else 1)
        order = torch.cat([torch.randperm(len(samples), generator=g)
                           for _ in range(-(-need // len(samples)))]).tolist()
        rows = _rows(samples, order, self.global_batch, self.seq_len, self.packing)
        width = self.seq_len if self.packing else min(self.seq_len, max(len(r[0].ids) for r in rows) - 1)
        return collate(rows, width)

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch * self.seq_len


def split_samples(samples, val_fraction: float, where: str) -> tuple:
    """(train, validation) samples: the last val_fraction of the records (of each file: Note [data of several
    files]), at least one."""
    from infinity.data.sources import SampleChain, split_parts
    parts = getattr(samples, "parts", None)
    if parts is not None:
        heads, tails = split_parts(parts, val_fraction, floor=1)
        train, val = SampleChain(heads), SampleChain(tails)
    else:
        n_val = max(1, int(len(samples) * val_fraction))
        train, val = samples[: len(samples) - n_val], samples[len(samples) - n_val:]
    if len(train) < 1 or len(val) < 1:
        raise ConfigError(f"{where}: {len(samples)} record(s): too few to hold out data.val_fraction for "
                          f"validation; add records or set data.val_path")
    return train, val
