"""Fixtures of the data tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny pretrained Llama directory with its byte-level BPE and chat template, and that tokenizer
    (test_finetune_data.py has its own `llama`, with the model too)."""
    pytest.importorskip("transformers")
    from test_finetune_data import make_llama
    path = tmp_path_factory.mktemp("llama")
    _, tok = make_llama(path)
    return path, tok
