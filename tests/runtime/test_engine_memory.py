"""memory_report() equals the plan's formula, per tier and kind, padding included."""

from __future__ import annotations

import weakref

import pytest
import torch

import infinity
from dist_utils import run_distributed
from infinity.models.gpt import GPT, GPTConfig

CFG = GPTConfig(vocab_size=67, seq_len=16, n_layer=3, n_head=4, d_model=36)  # odd sizes: padding shows


def unit_numels(cfg: GPTConfig) -> list[int]:
    """Elements per unit: the root (tied embedding/head, positions, final LayerNorm), then each block."""
    d = cfg.d_model
    token_embedding = cfg.vocab_size * d  # shared with the output head: counted once
    position_embedding = cfg.seq_len * d
    final_layernorm = 2 * d
    attention = (d * 3 * d + 3 * d) + (d * d + d)
    mlp = (d * 4 * d + 4 * d) + (4 * d * d + d)
    layernorms = 2 * (2 * d)
    return [token_embedding + position_embedding + final_layernorm] + [attention + mlp + layernorms] * cfg.n_layer


def expected_state(world: int, placement: dict, compute_bytes: int) -> dict:
    shards = [-(-n // world) for n in unit_numels(CFG)]  # each unit padded to a multiple of the world size
    per_rank = sum(shards)
    bytes_of = {"params": per_rank * compute_bytes, "grads": per_rank * 4,
                "master": per_rank * 4, "exp_avg": per_rank * 4, "exp_avg_sq": per_rank * 4}
    group = {"params": "params", "grads": "grads", "master": "optimizer", "exp_avg": "optimizer",
             "exp_avg_sq": "optimizer"}
    if compute_bytes == 4 and placement["params"] == placement["optimizer"] == "nvme":
        bytes_of["params"] = 0  # fp32 parameters are stored as the master (Note [aliased parameters])
    out = {t: {k: 0 for k in bytes_of} for t in ("device", "host", "nvme")}
    for kind, n in bytes_of.items():
        out[placement[group[kind]]][kind] = n
    return out


def report_for(rank, world, placement, dtype, swap_dir):
    torch.manual_seed(0)
    cfg = {"placement": placement, "precision": {"compute_dtype": dtype}}
    if "nvme" in placement.values():
        cfg["nvme"] = {"paths": [swap_dir]}
    with infinity.initialize(GPT(CFG), cfg) as engine:
        return engine.memory_report()


PLACEMENTS = [
    {"params": "device", "grads": "device", "optimizer": "device"},
    {"params": "host", "grads": "device", "optimizer": "nvme"},
    {"params": "nvme", "grads": "host", "optimizer": "host"},
    {"params": "nvme", "grads": "nvme", "optimizer": "nvme"},
]


@pytest.mark.parametrize("placement", PLACEMENTS, ids=lambda p: "-".join(p.values()))
@pytest.mark.parametrize("dtype,compute_bytes", [("fp32", 4), ("bf16", 2)])
def test_report_equals_formula(placement, dtype, compute_bytes, tmp_path):
    report = report_for(0, 1, placement, dtype, str(tmp_path))
    assert report["state"] == expected_state(1, placement, compute_bytes)
    assert report["plan"] == report["state"]
    nvme_state = sum(report["state"]["nvme"].values())
    assert report["nvme_reserved_bytes"] >= nvme_state


def _reports_ws2(rank, world, swap_dir):
    return [report_for(rank, world, p, "fp32", f"{swap_dir}/r{rank}") for p in PLACEMENTS]


def test_world_size_2_halves_per_rank_bytes(tmp_path):
    import os
    for r in range(2):
        os.makedirs(tmp_path / f"r{r}", exist_ok=True)
    per_rank = run_distributed(_reports_ws2, 2, str(tmp_path))
    for rank_reports in per_rank:
        for placement, report in zip(PLACEMENTS, rank_reports):
            assert report["state"] == expected_state(2, placement, 4), placement
    # Half of world size 1, up to the padding of each unit to a multiple of 2.
    whole = sum(unit_numels(CFG))
    half = sum(-(-n // 2) for n in unit_numels(CFG))
    assert 0 <= half - whole / 2 <= len(unit_numels(CFG)) / 2


def test_a_closed_engine_is_collected_and_its_state_freed():
    """Note [graph hooks]: once closed and dropped, nothing keeps the engine: a collection frees it and its
    state (the graph hooks had kept both alive: a second engine in one process ran out of memory on an H100)."""
    import gc
    import weakref
    torch.manual_seed(0)
    placement = {"params": "device", "grads": "host", "optimizer": "host"}
    engine = infinity.initialize(GPT(CFG), {"placement": placement, "optimizer": {"grad_clip": 1.0}})
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    for _ in range(2):
        engine.backward(engine(x, x))
        engine.step()
    state = [weakref.ref(s.resident) for s in engine.manager._shards.values() if s.resident is not None]
    held = weakref.ref(engine)
    engine.close()
    del engine
    gc.collect()
    assert held() is None and state and all(r() is None for r in state)


class _SavesItsOutput(torch.autograd.Function):
    """exp, saving its output as torch's exp does; each graph node it makes is recorded (weakly)."""

    nodes: list = []

    @staticmethod
    def forward(ctx, x):
        out = x.exp()
        ctx.save_for_backward(out)
        _SavesItsOutput.nodes.append(weakref.ref(ctx))
        return out

    @staticmethod
    def backward(ctx, grad):
        out, = ctx.saved_tensors
        return grad * out


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = _SavesItsOutput.apply(block(x).tanh())
        return x.square().mean()


@pytest.mark.parametrize("checkpoint", ["none", pytest.param("units", marks=pytest.mark.slow)])
def test_a_forward_whose_result_is_dropped_frees_its_graph(checkpoint):
    """Note [saved alias]: a forward with gradients whose loss is dropped without a backward (an evaluation outside
    torch.no_grad) frees its graph, as plain torch does at once, the engine by the next forward (its graph hooks,
    Note [graph hooks]) or close: the nodes of an op that saves its own output are collected (the activation
    meter's hook returned the tensor itself: output -> node -> output kept every such graph, and all it reached,
    for the process's life); the step after the evaluations matches the step without them."""
    import gc
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    _SavesItsOutput.nodes.clear()
    reference = _Blocks()
    reference(x)  # plain torch: dropped at once
    gc.collect()
    assert len(_SavesItsOutput.nodes) == 3 and all(r() is None for r in _SavesItsOutput.nodes)
    _SavesItsOutput.nodes.clear()
    cfg = {"activation": {"checkpoint": checkpoint}, "optimizer": {"lr": 1e-2}}
    params = []
    for evaluations in (3, 0):
        torch.manual_seed(1)
        with infinity.initialize(_Blocks(), cfg) as engine:
            for _ in range(evaluations):
                made = len(_SavesItsOutput.nodes)
                engine(x)  # an evaluation with gradients on, its loss dropped
                gc.collect()  # every earlier graph is gone (this one's hooks go at the next forward)
                assert all(r() is None for r in _SavesItsOutput.nodes[:made])
            engine.backward(engine(x))
            engine.step()
            params.append(engine.full_state_dict())
    gc.collect()
    assert len(_SavesItsOutput.nodes) == 3 * (3 + 1 + 1) and all(r() is None for r in _SavesItsOutput.nodes)
    assert params[0].keys() == params[1].keys() and all(torch.equal(params[0][k], params[1][k]) for k in params[0])
