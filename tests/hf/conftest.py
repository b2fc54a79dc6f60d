"""The trainers' tests: tiny matrices."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matrices: one intra-op thread (the default, one per core, spent most of the reference's time
    waiting on the shared machine's cores)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
