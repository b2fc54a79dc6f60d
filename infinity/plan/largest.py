"""`infinity estimate --largest FAMILY`: the largest model of a family that trains on this machine, for full
fine-tuning and for LoRA, with the plan for each.

Note [largest model]: a family is a ladder of standard shapes, smallest first (LADDERS; the Llama ladder is
Llama / Llama 2 / Llama 3 / TinyLlama / OpenLLaMA shapes from 125M to 405B parameters at the Llama-2 vocabulary
of 32,000 ids). Each rung is judged by the normal estimate of the job with the rung's shape (`judge`: the job's
own `--set` lines, its budgets, this machine's memory and disks, and the plan search of Note [plan search]):
a rung trains here when its configured run fits, or a plan of the search does (a plan that raises the budgets
does not count: the budgets are the user's). The ladder is bisected (fitting is monotone along it: every rung
has more parameters, wider layers and no fewer blocks than the one below), so a 10-rung ladder costs 4
estimates per mode, each fast by Note [deepened estimate]. The rungs are 2-4x apart in parameters, so the gap
above the answer is bisected too: the next rung's width with fewer of its blocks (`Rung.with_layers`, named
`llama-7B-17L`), from the first that has more parameters than the answer (fitting is monotone in the blocks at
one width), up to 6 estimates more. On the 2-core, 23 GiB machine with 68 GiB of free disk (2026-11-28, seq
256, no checkpoint) the full fine-tune's answer went from llama-1.1B to llama-7B-17L (3.70B) and LoRA's from
llama-7B to llama-13B-35L (11.44B); with the auto policy among the plans (Note [plan search]) to llama-7B-19L
(4.11B, trained: RESULTS D32) and llama-13B (13.03B). Each answer says the share of the machine its training state takes
(`Verdict.share`: the state as its plan stores it over the free GPU memory, the RAM available and the swap
disk's free space), the capacity the answer is measured against (benchmarks/bench_largest.py, the GPU check's
bar: at least 0.8). Full fine-tuning judges the shape as `model.kind =
"llama"` with its sizes; LoRA as a pretrained model of that shape (a config.json written to a temporary
directory, no weights: the estimate reads none) with `model.lora.r = 16`. The answer names the rung, its
parameters, the `--set` lines of its plan, the binding memory (the one nearest its limit: the RAM by the run's
predicted peak RSS, the disk by its swap, each against what is left beyond memory.headroom: Note [headroom]), the
margins it keeps, the predicted step, and why the next shape does not fit with what it lacks as configured.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Callable

from infinity.plan.table import configured_row, seconds_text
from io_engine import format_size


@dataclass(frozen=True)
class Rung:
    name: str
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int = 32000

    @property
    def num_params(self) -> int:
        """Its parameters as models/llama.py (and transformers' LlamaForCausalLM) builds it: no biases, the
        embedding and the output head untied, two RMSNorm weights a block and a final one."""
        head = self.d_model // self.n_head
        attention = 2 * self.d_model * head * (self.n_head + self.n_kv_head)
        block = attention + 3 * self.d_model * self.ffn_dim + 2 * self.d_model
        return 2 * self.vocab_size * self.d_model + self.n_layer * block + self.d_model

    def with_layers(self, n_layer: int) -> "Rung":
        """This rung's width with `n_layer` blocks, named for both (a shape between two rungs: Note [largest
        model])."""
        return dataclasses.replace(self, name=f"{self.name}-{n_layer}L", n_layer=n_layer)

    def sets(self) -> list[str]:
        """The job's `--set` lines of this shape (`model.kind = "llama"`)."""
        return ['model.kind="llama"', f"model.d_model={self.d_model}", f"model.n_layer={self.n_layer}",
                f"model.n_head={self.n_head}", f"model.n_kv_head={self.n_kv_head}", f"model.ffn_dim={self.ffn_dim}",
                f"model.vocab_size={self.vocab_size}"]

    def pretrained(self, root: str, seq_len: int) -> str:
        """A directory holding this shape's config.json (transformers' LlamaConfig, no weights)."""
        from infinity.models.build import need_transformers
        transformers = need_transformers("--largest llama", "or estimate a job's own model")
        path = os.path.join(root, self.name)
        transformers.LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.d_model, intermediate_size=self.ffn_dim,
                                 num_hidden_layers=self.n_layer, num_attention_heads=self.n_head,
                                 num_key_value_heads=self.n_kv_head, max_position_embeddings=max(seq_len, 4096),
                                 bos_token_id=None, eos_token_id=None, pad_token_id=None).save_pretrained(path)
        return path


LADDERS: dict[str, tuple[Rung, ...]] = {
    "llama": (
        Rung("llama-125M", 768, 12, 12, 12, 2048),
        Rung("llama-350M", 1024, 24, 16, 16, 2816),
        Rung("llama-760M", 1536, 24, 16, 16, 4096),
        Rung("llama-1.1B", 2048, 22, 32, 4, 5632),  # TinyLlama
        Rung("llama-3B", 3200, 26, 32, 32, 8640),  # OpenLLaMA 3B
        Rung("llama-7B", 4096, 32, 32, 32, 11008),  # Llama 2 7B
        Rung("llama-13B", 5120, 40, 40, 40, 13824),  # Llama 2 13B
        Rung("llama-34B", 8192, 48, 64, 8, 22016),  # Code Llama 34B
        Rung("llama-70B", 8192, 80, 64, 8, 28672),  # Llama 2 70B
        Rung("llama-405B", 16384, 126, 128, 8, 53248),  # Llama 3.1 405B
    ),
}
MODES = ("full fine-tuning", "LoRA (r=16)")
LORA_SETS = ("model.lora.r=16",)


@dataclass
class Verdict:
    """One rung in one mode, judged by the normal estimate."""

    rung: Rung
    estimate: object  # estimate.Estimate
    plan: list[str] | None  # the plan's `--set` lines ([]: the configured run fits; None: nothing fits)
    row: object = None  # estimate_table.Row of the run with the plan
    peak: dict = field(default_factory=dict)  # that run's predicted peak per rank (Note [peak memory])

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def share(self) -> tuple[int, int]:
        """Its training state's bytes on every rank of this machine (parameters, gradients, optimizer state, as the
        plan stores them) and what the machine has free for it: the GPUs' free memory, the RAM available and the
        swap disk's free space (the RAM once without a GPU: it is the device tier too). Note [largest model]."""
        est, plan = self.estimate, self.row.plan if self.row is not None else None
        state = sum(sum(kinds.values()) for kinds in plan.state_bytes().values()) if plan is not None else 0
        room = est.room
        free = room.get("ram_available", 0) + room.get("disk_free", 0) + (
            est.budgets.device * est.local_world_size if est.cuda else 0)
        return state * est.local_world_size, free

    def why_not(self) -> str:
        me = configured_row(self.estimate.table)
        why = list(me.over.values()) if me is not None and me.over else [
            f"{c.name}: {c.detail}" for c in self.estimate.checks if not c.ok and c.level == "error"]
        lacks = lacking(self.estimate)
        return "; ".join(why) + "; and no plan of the search fits" + (f" (as configured it lacks {lacks})"
                                                                       if lacks else "")


def verdict(rung: Rung, est) -> Verdict:
    """Whether the estimate `est` of a rung's job trains here, and with which plan (Note [largest model])."""
    me = configured_row(est.table)
    if me is not None and me.fits and est.ok:
        return Verdict(rung, est, [], me, dict(est.peak))
    if est.plans and not est.budget_raised:
        p = est.plans[0]
        return Verdict(rung, est, list(p.sets), p.row, dict(p.verdict.peak) if p.verdict else {})
    return Verdict(rung, est, None)


@dataclass
class Answer:
    mode: str
    largest: Verdict | None  # None: not even the smallest rung trains here
    above: Verdict | None  # the next shape judged, a rung or one between two (None: the answer is the ladder's top)
    judged: list[str] = field(default_factory=list)  # the rungs estimated, in order


def largest(ladder: tuple[Rung, ...], judge: Callable[[Rung], object], mode: str) -> Answer:
    """Bisect `ladder` for its largest rung that `judge(rung)` (an Estimate) says trains here, then the shapes
    between it and the next rung: the next rung's width with fewer blocks (Note [largest model])."""
    fitting, failing, judged = _bisect(list(ladder), judge)
    if failing is None:
        return Answer(mode, fitting, None, judged)
    above = failing.rung
    floor = fitting.rung.num_params if fitting is not None else 0
    fewer = [above.with_layers(n) for n in range(1, above.n_layer) if above.with_layers(n).num_params > floor]
    better, worse, more = _bisect(fewer, judge)
    return Answer(mode, better or fitting, worse or failing, judged + more)


def _bisect(shapes: list[Rung], judge: Callable[[Rung], object]) -> tuple[Verdict | None, Verdict | None, list[str]]:
    """The verdicts of the largest of `shapes` that fits and of the one after it (None: all fit, or none is
    judged), fitting being monotone along them; and the names judged, in order."""
    seen: dict[int, Verdict] = {}
    lo, hi = -1, len(shapes)  # shapes[lo] fits, shapes[hi] does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        seen[mid] = verdict(shapes[mid], judge(shapes[mid]))
        lo, hi = (mid, hi) if seen[mid].fits else (lo, mid)
    return seen.get(lo), seen.get(hi), [shapes[i].name for i in seen]


def binding(est, row, peak: dict | None = None) -> str:
    """The memory of `row` nearest its limit, with its use (Note [headroom]): the RAM by the run's predicted peak
    RSS (`peak`, all ranks of the node) against the RAM available less memory.headroom, the GPU's memory by its
    budget, the disk by the swap bytes against the free disk less memory.headroom."""
    b, budgets, room = row.bytes, est.budgets, est.room
    ranks = est.local_world_size
    ram_need = (peak or {}).get("ram") or (b["host"] + (0 if est.cuda else b["device"]))
    uses = {"ram": (ram_need * ranks, room.get("ram_available", budgets.host * ranks) - room.get("ram_headroom", 0))}
    if est.cuda:
        uses["device"] = (b["device"], budgets.device)
    if b["nvme"]:
        uses["disk"] = (b["nvme"] * ranks, room.get("disk_free", budgets.nvme * ranks) - room.get("disk_headroom", 0))
    name, (need, have) = max(uses.items(), key=lambda kv: kv[1][0] / max(1, kv[1][1]))
    return f"{name}: {_fmt(need)} of {_fmt(have)}"


def kept(est) -> str:
    """The margins the answer keeps (Note [headroom])."""
    room = est.room
    out = [f"{_fmt(room['ram_headroom'])} of RAM ({_fmt(room['ram_available'])} available now)"] \
        if "ram_headroom" in room else []
    if "disk_headroom" in room:
        out.append(f"{_fmt(room['disk_headroom'])} of disk ({_fmt(room['disk_free'])} free)")
    return " and ".join(out)


def lacking(est) -> str:
    """What the configured run of `est` lacks, beyond the margins memory.headroom keeps (Note [headroom])."""
    room, out = est.room, []
    ram = est.peak.get("ram")
    if ram and "ram_available" in room:
        short = ram * est.local_world_size + room["ram_headroom"] - room["ram_available"]
        if short > 0:
            out.append(f"{_fmt(short)} of RAM")
    state = est.state()
    swap = sum(state.get("nvme", {}).values())
    if swap and "disk_free" in room:
        short = swap * est.local_world_size + room["disk_headroom"] - room["disk_free"]
        if short > 0:
            out.append(f"{_fmt(short)} of disk")
    return " and ".join(out)


def _fmt(n: int) -> str:
    return format_size(n, exact=False)


def format_answers(family: str, seq_len: int, answers: list[Answer]) -> str:
    lines = [f"the largest {family}-shaped model that trains on this machine at model.seq_len = {seq_len} "
             f"(each rung judged by the estimate of this job; ladder: "
             f"{', '.join(r.name for r in LADDERS[family])}):"]
    for a in answers:
        lines.append("")
        if a.largest is None:
            lines.append(f"  {a.mode}: none; the smallest shape judged, {a.above.rung.name}, does not fit: "
                         f"{a.above.why_not()}")
            continue
        v, est = a.largest, a.largest.estimate
        lines.append(f"  {a.mode}: {v.rung.name}, {est.num_params / 1e9:.2f}B parameters; predicted step "
                     f"{seconds_text(v.row.step_s)}; binding {binding(est, v.row, v.peak)}")
        state, free = v.share()
        if state and free:
            lines.append(f"     its training state, {_fmt(state)}, is {state / free:.0%} of what this machine has free "
                         f"for it ({_fmt(free)}: {'GPU memory, ' if est.cuda else ''}RAM and swap disk)")
        if kept(est):
            lines.append(f"     it keeps {kept(est)} unused (memory.headroom)")
        model = v.rung.sets() if a.mode == MODES[0] else ["model.pretrained=<your model of this shape>", *LORA_SETS]
        lines += [f"     --set {s}" for s in model + v.plan]
        if not v.plan:
            lines.append("     (the job as configured: no change needed)")
        if a.above is not None:
            lines.append(f"  the next shape, {a.above.rung.name} ({a.above.estimate.num_params / 1e9:.2f}B), does "
                         f"not fit: {a.above.why_not()}")
        else:
            lines.append("  (the top of the ladder)")
    return "\n".join(lines)


def run(family: str, seq_len: int, judge_job: Callable[[list[str]], object],
        ladder: tuple[Rung, ...] | None = None) -> list[Answer]:
    """Both modes' answers; `judge_job(sets)` estimates the job with `sets` after its own `--set` lines."""
    ladder = ladder or LADDERS[family]
    with tempfile.TemporaryDirectory(prefix="infinity-largest-") as root:
        full = largest(ladder, lambda r: judge_job(r.sets()), MODES[0])
        # (a rung's stand-in directory holds only its config.json: its data term counts byte tokens, not the user's
        # tokenizer's ids, 3 bytes per token of one batch's reads less)
        lora = largest(ladder, lambda r: judge_job([f"model.pretrained={r.pretrained(root, seq_len)}",
                                                    "model.tokenizer=bytes", *LORA_SETS]), MODES[1])
    return [full, lora]
