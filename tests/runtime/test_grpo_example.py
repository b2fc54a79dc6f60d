"""examples/grpo_colocated.py for two iterations (the smoke run; the learning curve is docs/rl.md's): weights
pushed, trainer offloaded around the rollouts, one GRPO update each (the offload and reload spans in the profile:
test_offload_states.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo_colocated.py"


def test_two_iterations(tmp_path):
    spec = importlib.util.spec_from_file_location("grpo_colocated", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    curve = example.main(["--iterations", "2", "--prompts", "4", "--group", "4", "--out", str(tmp_path / "c.json")])
    assert len(curve) == 2 and all(0 <= r <= 1 for r in curve)
    assert json.loads((tmp_path / "c.json").read_text()) == curve
