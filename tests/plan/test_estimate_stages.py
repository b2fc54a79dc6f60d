"""`infinity estimate --stages` (infinity/plan/scaling.py) against the seeds' formulas and the link model by hand."""

from __future__ import annotations

import json

import pytest
import torch

import infinity
from infinity.config.job import ModelConfig
from infinity.job.cli import main
from infinity.memory.cost_model import LinkRates
from infinity.memory.placement import plan_for_config
from infinity.memory.plan import Budgets
from infinity.memory.tier import Kind, Tier
from infinity.models.build import build_model
from infinity.plan import estimate as est
from infinity.plan import scaling
from stage_formulas import FORMULAS

SMALL = ModelConfig(n_layer=2, d_model=48, n_head=4, seq_len=16, vocab_size=300)  # odd sizes: padding shows
ROOMY = Budgets(device=1 << 40, host=1 << 40, nvme=1 << 40)
RATES = LinkRates(nvme_read=2e9, nvme_write=1e9, cpu_adam=5e8, device_adam=5e8, matmul_flops=1e11, source="test")


def config(tmp_path, placement=("device", "host", "nvme"), **sections) -> infinity.Config:
    params, grads, optimizer = placement
    return infinity.Config.from_dict({"placement": {"params": params, "grads": grads, "optimizer": optimizer,
                                                    "tail_units": 0},  # (the formulas of uniform placements)
                                      "precision": {"compute_dtype": "bf16"}, "nvme": {"paths": [str(tmp_path)]},
                                      **sections})


def report(cfg, world, nodes=1, budgets=ROOMY, **kw) -> scaling.StageReport:
    return scaling.estimate_stages(lambda: build_model(SMALL), cfg, scaling.Cluster(world, nodes), budgets=budgets,
                                   trace=False, cuda=False, **kw)


def num_params() -> int:
    model = build_model(SMALL).model
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("world", [1, 2, 3])
def test_stage_table_meets_the_formulas(world, tmp_path):
    """Per rank and tier (params on device, gradients on host, optimizer on NVMe), bf16: each stage's bytes are
    the formula's terms, up to padding (at most world - 1 elements of 18 bytes per unit)."""
    rep = report(config(tmp_path), world)
    psi, units = num_params(), est.unit_sizes_of(build_model(SMALL).model, config(tmp_path), world)
    pad = len(units) * (world - 1) * 18 + 18
    # which kinds are partitioned, by stage (the list, not the code's flags)
    split = {0: (), 1: ("optimizer",), 2: ("grads", "optimizer"), 3: ("params", "grads", "optimizer")}
    for row in rep.rows:
        assert row.fits, row.error
        assert abs(sum(row.state.values()) - FORMULAS[row.stage](psi, world)) <= pad, (row.stage, row.state)
        per = {"params": 2 * psi, "grads": 4 * psi, "optimizer": 12 * psi}
        expected = {group: n / world if group in split[row.stage] else n for group, n in per.items()}
        got = {"params": row.state[Tier.DEVICE], "grads": row.state[Tier.HOST], "optimizer": row.state[Tier.NVME]}
        for group in per:
            assert abs(got[group] - expected[group]) <= pad, (row.stage, group, got, expected)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_stage_table_is_the_estimates_byte_model(stage, tmp_path):
    """The table's bytes per tier are what `infinity estimate` (and the engine's memory_report) count at that
    stage: one byte model, not a second formula."""
    cfg = config(tmp_path)
    row = report(cfg, 2).rows[stage]
    single = est.estimate(lambda: build_model(SMALL), cfg.with_overrides([f"zero.stage={stage}"]), world_size=2,
                          batch_size=1, seq_len=SMALL.seq_len, rates=RATES, cuda=False, budgets=ROOMY)
    assert {t.value: n for t, n in row.state.items()} == {t: sum(k.values()) for t, k in single.state().items()}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_per_step(world, tmp_path):
    psi = num_params()
    rows = report(config(tmp_path), world).rows
    if world == 1:
        assert all(r.comm_elements == r.comm_bytes == 0 for r in rows)
        return
    assert [r.comm_elements for r in rows] == [2 * psi, 2 * psi, 2 * psi, 3 * psi]
    # fp32 gradients reduced (all-reduce: twice), bf16 parameters gathered (stage 3: forward and backward)
    assert [r.comm_bytes for r in rows] == [8 * psi, 4 * psi + 2 * psi, 4 * psi + 2 * psi, 4 * psi + 4 * psi]


def test_fits_is_the_planners_check(tmp_path):
    """A host budget between stage 0's bytes and stage 1's: stage 0 does not fit (the planner's message), the
    others do; the row still shows what stage 0 would need."""
    psi, world = num_params(), 3
    host = (FORMULAS[0](psi, world) + FORMULAS[1](psi, world)) // 2
    rep = report(config(tmp_path, ("host", "host", "host")), world,
                 budgets=Budgets(device=1 << 40, host=int(host), nvme=0))
    assert [r.fits for r in rep.rows] == [False, True, True, True]
    assert "host tier needs" in rep.rows[0].error
    assert rep.rows[0].state[Tier.HOST] > host


def test_link_model_by_hand():
    assert scaling.network_bytes(1000, scaling.Cluster(8, 2)) == {"intra_node": 750, "inter_node": 500}
    assert scaling.network_bytes(1000, scaling.Cluster(4, 1)) == {"intra_node": 750, "inter_node": 0}
    assert scaling.network_bytes(1000, scaling.Cluster(4, 4)) == {"intra_node": 0, "inter_node": 750}
    assert scaling.network_bytes(1000, scaling.Cluster(1, 1)) == {"intra_node": 0, "inter_node": 0}
    with pytest.raises(infinity.ConfigError, match="multiple of the node count"):
        scaling.Cluster(6, 4)


def test_network_bytes_per_stage(tmp_path):
    """8 ranks on 2 nodes: each collective's bytes split 3/4 over NVLink per rank and 1/2 over the node's
    network (Note [link model]); the per-rank share of the node's network is 1/4 of it."""
    rep = report(config(tmp_path), 8, nodes=2)
    for row in rep.rows:
        assert abs(row.link_bytes["intra_node"] - row.comm_bytes * 3 / 4) <= 2, row
        assert abs(row.link_bytes["inter_node"] - row.comm_bytes / 2) <= 2, row
        assert abs(row.links["inter_node"] - row.comm_bytes / 8) <= 2, row


def test_hardware_preset_prices_every_link(tmp_path):
    """On a preset node (GPUs: PCIe counted) every stage has a step time; NVMe bytes per node are the rank's
    times the ranks per node."""
    rep = scaling.estimate_stages(lambda: build_model(SMALL), config(tmp_path), scaling.Cluster(16, 2),
                                  hardware=scaling.HARDWARE["dgx-h100"], trace=False)
    for row in rep.rows:
        assert row.fits and row.step_time.total > 0
        assert row.link_bytes["nvme_read"] == 8 * row.links["nvme_read"] > 0
        assert row.links["d2h"] > 0  # gradients leave the GPU for the host tier
        assert row.step_time.fb["inter_node"] > 0


def test_cli_stages(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["estimate", "--set", "model.n_layer=2", "--set", "model.d_model=32", "--set", "run.batch_size=4",
            "--set", 'precision.compute_dtype="bf16"']
    assert main(args + ["--world", "4", "--nodes", "2", "--no-trace"]) == 0
    out = capsys.readouterr().out
    for line in ("0 DDP", "1 ZeRO-1", "2 ZeRO-2", "3 ZeRO-3", "inter_node", "bound by"):
        assert line in out, out
    assert main(args + ["--stages", "--world", "2", "--hardware", "dgx2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3] and data["hardware"]["name"] == "dgx2"
    assert data["flops_per_step"] > 0  # traced
    assert main(args + ["--world", "4", "--nodes", "3"]) == 2
    assert "multiple of the node count" in capsys.readouterr().err
    assert main(args + ["--stages", "--hardware", "nope"]) == 2
    assert "dgx-h100" in capsys.readouterr().err


def test_a_stage_that_does_not_fit_shows_its_placements_bytes_without_tail_units(tmp_path):
    """The bytes of a placement that does not fit are planned without budgets; tail_units = "auto" then took
    half of the trainable state onto a device of unlimited room (a 70B at stage 0 showed 824 GiB on an 80 GB
    GPU). Its bytes are the placement's own: params on the device, gradients and optimizer on the host."""
    psi = num_params()
    cfg = infinity.Config.from_dict({"placement": {"params": "device", "grads": "host", "optimizer": "host"},
                                     "precision": {"compute_dtype": "bf16"}})
    row = report(cfg, 1, budgets=Budgets(device=1000, host=1 << 40, nvme=0)).rows[0]
    assert not row.fits and "device tier needs" in row.error
    pad = 18 * len(est.unit_sizes_of(build_model(SMALL).model, cfg, 1))
    assert abs(row.state[Tier.DEVICE] - 2 * psi) <= pad and abs(row.state[Tier.HOST] - 16 * psi) <= pad, row.state


def test_auto_tail_units_leave_the_traced_activations_their_room():
    """Note [tail units]: "auto" took half of the free device memory, the other half assumed for the activations,
    which the planner did not know; a stage that fits without tail units then did not fit with them (the 70B of
    docs/scaling.md on 50 GB: 50.08 GiB needed of 46.57). The estimate now plans them within half of what its
    traced activations leave: on a device with the plan's parameters, the activations and a little more, no tail
    unit, and the stage fits, as it does with tail_units = 0."""
    cfg = infinity.Config.from_dict({"placement": {"params": "device", "grads": "host", "optimizer": "host"}})
    roomy = Budgets(device=1 << 40, host=1 << 40, nvme=0)
    base = scaling.estimate_stages(lambda: build_model(SMALL), cfg, scaling.Cluster(1, 1), budgets=roomy,
                                   trace=True, cuda=True, batch_size=8, seq_len=16)
    acts = est.activation_bytes(base.trace, cfg.activation)["device"]
    units = est.unit_sizes_of(build_model(SMALL).model, cfg, 1)
    without = cfg.with_overrides(["placement.tail_units=0"])
    params = plan_for_config(units, without, roomy).tier_totals()[Tier.DEVICE]  # (parameters, working buffers)
    first = 16 * units[0].numel(Kind.MASTER)  # the first unit's gradients and optimizer state
    assert acts > 2 * first  # (what the device must hold besides: the activations, more than a tail unit)
    tight = Budgets(device=params + acts + first // 2, host=1 << 40, nvme=0)
    for own in (cfg, without):
        rep = scaling.estimate_stages(lambda: build_model(SMALL), own, scaling.Cluster(1, 1), budgets=tight,
                                      trace=True, cuda=True, batch_size=8, seq_len=16)
        assert all(row.fits for row in rep.rows), [(row.stage, row.error) for row in rep.rows]
        assert all(plan_for_config(units, own, tight.reserving(acts)).tier(u, Kind.MASTER) is Tier.HOST
                   for u in range(len(units)))
    unknown = Budgets(device=tight.device, host=1 << 40, nvme=0)  # the half rule, kept where nothing was traced
    plan = plan_for_config(units, cfg, unknown)
    assert plan.tier(0, Kind.MASTER) is Tier.DEVICE  # (it would take the first unit: the overflow this prevents)
    assert plan.tier_totals()[Tier.DEVICE] + acts > tight.device
    assert plan_for_config(units, cfg, unknown.reserving(acts)).tier(0, Kind.MASTER) is Tier.HOST
    assert unknown.reserving(acts).reserving(0).activations == acts  # (a size set first stays)


def test_a_set_activation_reserve_wins_on_a_preset_machine_as_on_this_one():
    """memory.activation_reserve set to a size is what tail units leave on --hardware's budgets too (it was
    ignored there: the preset's budgets came without it), and on this machine's; "auto" leaves it to the trace."""
    from infinity.machine.environment import resolve_budgets
    sized = infinity.Config.from_dict({"memory": {"activation_reserve": "1MiB"}})
    assert scaling.HARDWARE["dgx-h100"].budgets(sized, 8).activations == 1 << 20
    assert resolve_budgets(sized.memory, torch.device("cpu"), 1, 0).activations == 1 << 20
    auto = infinity.Config()
    assert scaling.HARDWARE["dgx-h100"].budgets(auto, 8).activations is None
    assert scaling.HARDWARE["dgx-h100"].budgets(auto, 8).reserving(5).activations == 5
