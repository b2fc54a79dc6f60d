"""What `infinity train` says, and when: `--quiet` keeps the final line (and a damaged checkpoint passed over); a
data.format the job gives is obeyed, never replaced by what detection finds (Note [data format from the records]);
a data file in another encoding is called that, with the conversion, not "binary" (Note [text in another
encoding]). The references: the lines a run without --quiet prints, the records as written, the bytes as Python's
own codecs encode them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from infinity.config.options import ConfigError
from infinity.data.batches import load_tokens
from infinity.data.samples import DataError, read_records
from infinity.data.tokenized import resolve_data_format
from infinity.job.cli import main
from infinity.job.spec import load_job

TINY = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.seq_len=32", "run.batch_size=4",
        "run.eval_batches=1", "run.eval_every=0", "run.steps=4", "run.checkpoint_every=2", "run.log_every=1"]



def _sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _lines(capsys) -> list[str]:
    got = capsys.readouterr()
    return [line for line in (got.out + got.err).splitlines() if line.strip()]


# ------------------------------------------------------------------ --quiet


@pytest.fixture(scope="module")
def loud_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run without --quiet: its directory and the lines it printed (the reference for the final line)."""
    import contextlib
    import io
    root = tmp_path_factory.mktemp("runs")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["train", *_sets(TINY + [f"run.dir={root}", "run.name=loud"])]) == 0
    return root / "loud", [line for line in out.getvalue().splitlines() if line.strip()]


def test_quiet_prints_the_final_line_and_nothing_else(loud_run, tmp_path, capsys):
    _, loud = loud_run
    final = [line for line in loud if line.startswith("completed after 4 steps")]
    assert len(loud) > 3 and len(final) == 1, loud
    assert main(["train", "--quiet", *_sets(TINY + [f"run.dir={tmp_path}", "run.name=q"])]) == 0
    quiet = _lines(capsys)
    assert len(quiet) == 1 and quiet[0].startswith("completed after 4 steps in "), quiet
    assert quiet[0].endswith(f"run directory {tmp_path / 'q'}"), quiet
    # the same line as the loud run's, up to the figures that vary (seconds, peak RSS) and the directory
    shape = [part.split(" in ")[0] for part in (final[0], quiet[0])]
    assert shape[0] == shape[1]


def test_quiet_resume_still_names_the_damaged_checkpoint_it_passed_over(loud_run, tmp_path, capsys):
    """Never a silent fallback, not even with --quiet: the damage, then the final line, nothing else."""
    run = tmp_path / "loud"
    shutil.copytree(loud_run[0], run)
    manifest = run / "checkpoint" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:40])  # truncated
    capsys.readouterr()
    assert main(["train", "--quiet", "--resume", str(run), "--set", "run.steps=6"]) == 0
    lines = _lines(capsys)
    assert len(lines) == 2, lines
    assert f"{run / 'checkpoint'} is damaged" in lines[0] and "manifest.json is corrupted" in lines[0], lines
    assert f"kept as {run / 'checkpoint.damaged'}" in lines[0] and "the 2 tried" in lines[0], lines  # it and step 4
    assert lines[1].startswith("completed after 6 steps"), lines


# ------------------------------------------------------------------ an explicit data.format


CHAT = {"messages": [{"role": "user", "content": "two plus two?"}, {"role": "assistant", "content": "Four."}]}


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_an_explicit_text_format_on_chat_records_is_refused_naming_both(tmp_path):
    chat = _jsonl(tmp_path / "c.jsonl", [CHAT] * 3)
    # the default is replaced by what the records are, and a line says so (the behaviour kept)
    job, said = resolve_data_format(load_job(None, [f"data.path={chat}"]))
    assert job.data.format == "chat" and said and 'data.format = "chat"' in said
    # given with --set, or in a job file, "text" is the user's word: obeyed, so the mismatch is refused
    job_file = tmp_path / "job.toml"
    job_file.write_text(f'[data]\npath = "{chat}"\nformat = "text"\n')
    for job in (load_job(None, [f"data.path={chat}", "data.format=text"]), load_job(job_file)):
        with pytest.raises(ConfigError) as e:
            resolve_data_format(job)
        said = str(e.value)
        assert 'data.format = "text"' in said and "chat record" in said and 'set data.format = "chat"' in said, said
        assert f"{chat} line 1" in said and "\n" not in said, said


def test_an_explicit_format_the_records_have_is_kept_and_plain_text_is_unchanged(tmp_path):
    chat = _jsonl(tmp_path / "c.jsonl", [CHAT] * 3)
    job, said = resolve_data_format(load_job(None, [f"data.path={chat}", "data.format=chat"]))
    assert job.data.format == "chat" and said is None
    plain = tmp_path / "p.txt"
    plain.write_text("In the beginning was the word.\n" * 20)
    for sets in ([], ["data.format=text"]):
        job, said = resolve_data_format(load_job(None, [f"data.path={plain}", *sets]))
        assert job.data.format == "text" and said is None


def test_text_records_outside_a_jsonl_file_are_refused(tmp_path):
    """Note [text records]: a .jsonl file's "text" records train as text; the same lines in a .txt file would
    train on their JSON syntax, so they are refused naming the rename."""
    texts = _jsonl(tmp_path / "t.jsonl", [{"text": "hello"}] * 3)
    assert resolve_data_format(load_job(None, [f"data.path={texts}", "data.format=text"]))[0].data.format == "text"
    lines = tmp_path / "t.txt"
    lines.write_bytes(texts.read_bytes())
    with pytest.raises(ConfigError, match=r'JSON lines with a "text" field in a file that is not .jsonl.*name it '
                                          r"\*.jsonl"):
        resolve_data_format(load_job(None, [f"data.path={lines}", "data.format=text"]))


# ------------------------------------------------------------------ text in another encoding


LATIN = "Le café de la gare\nà côté du théâtre\n" * 5


def test_latin1_text_is_named_with_its_conversion_not_called_binary(tmp_path):
    f = tmp_path / "fr.txt"
    f.write_bytes(LATIN.encode("latin-1"))
    with pytest.raises(ConfigError) as e:
        load_tokens(str(f))
    said = str(e.value)
    assert "line 1: not UTF-8" in said and "byte 6: b'\\xe9'" in said, said  # "Le caf" is 6 bytes
    assert "Latin-1" in said and "binary" not in said.replace("not binary data", ""), said
    assert "'Le café de la gare'" in said and f"iconv -f latin1 -t utf-8 {f}" in said, said
    # the fix it names works: the converted file loads, byte for byte the UTF-8 text
    f.write_bytes(LATIN.encode("latin-1").decode("latin-1").encode("utf-8"))
    assert bytes(load_tokens(str(f)).tolist()) == LATIN.encode("utf-8")


def test_utf16_text_is_named_and_binary_data_still_called_binary(tmp_path):
    f = tmp_path / "w.txt"
    f.write_bytes(LATIN.encode("utf-16"))  # with its byte-order mark, as Windows tools write it
    with pytest.raises(ConfigError, match=r"UTF-16 text .*iconv -f utf-16 -t utf-8"):
        load_tokens(str(f))
    f.write_bytes(bytes(range(256)) * 8)
    with pytest.raises(ConfigError, match=r"looks binary \(NUL or control bytes\)"):
        load_tokens(str(f))


def test_a_latin1_jsonl_line_is_named_too(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_bytes(b'{"prompt": "ok", "completion": "yes"}\n'
                  + json.dumps({"prompt": "caf\u00e9?", "completion": "oui"}, ensure_ascii=False).encode("latin-1")
                  + b"\n")
    with pytest.raises(DataError) as e:
        read_records(str(f))
    said = str(e.value)
    assert f"{f} line 2: not UTF-8" in said and "Latin-1" in said and "binary" not in said.replace(
        "not binary data", ""), said


def test_infinity_config_writes_the_format_train_reads_so_its_output_trains_as_it_says(tmp_path, capsys):
    """`infinity config` prints a job file ("train again with: infinity train --config <this file>"): with the
    detected format in it, the explicit format it then holds is the records' own, not a "text" that is refused."""
    chat = _jsonl(tmp_path / "c.jsonl", [CHAT] * 3)
    assert main(["config", "--set", f"data.path={chat}"]) == 0
    job_file = tmp_path / "job.toml"
    job_file.write_text(capsys.readouterr().out)
    job, said = resolve_data_format(load_job(job_file))
    assert job.data.format == "chat" and said is None
