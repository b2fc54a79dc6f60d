"""Preflight: can this machine run this plan? Checked before any state is built.

`initialize` (through `require`) and `infinity estimate` (which prints every line)
run the same checks:

    placement fits the budgets   the plan exists (the planner's message when not)
    free RAM / free GPU memory   the predicted bytes of every rank on this node
    nvme path <p>                Note [nvme paths]: the one check of a swap path
    free disk                    each filesystem holds its stripes of the NVMe state, plus the
                                 checkpoints when they are saved on it (Note [checkpoint space])
    locked memory                the pinned / mlock'ed staging against RLIMIT_MEMLOCK (a warning)

Note [nvme paths]: a swap path must be a writable directory. `check_nvme_path` is the one
answer: a file (or a path below a file) is refused naming it, a missing path is refused
(or, where the job creates it at start, accepted when its nearest existing parent is a
writable directory), an unwritable directory is refused after a probe file fails. The
engine (`check_nvme_paths`), the job (`prepare_nvme_paths`, which then creates its own <run>/swap and no
path the user named: Note [run paths]) and `infinity estimate` (`check_disks`) all ask it.

Note [checkpoint space]: a checkpoint holds, for every rank, the fp32 master and both Adam
moments of every optimizer sub-group and its frozen parameters in the compute dtype (none when
they are references to the pretrained files: Note [pretrained references]), each record placed
as the rank file places it (4 KiB-aligned, or 64-byte-aligned under 4 KiB), the rank's index and RNG
states, and on rank 0 the manifest (infinity/state/checkpoint.py; rank 0's copy of the model's
buffers is not counted: the plan does not know them, and they are small beside the state). While
one is written the `keep_last` before it stay on disk, so the checkpoint directory's
filesystem must hold keep_last + 1 of them for every rank of the node, or as many as the run saves
(`checkpoint.saves`, which `infinity train` sets) when that is fewer, or, with keep_last = 0 (keep all),
every one it saves (unknown, `saves = 0`: one is counted, and every later save needs as much again).
`[checkpoint] dir` names the directory (`infinity train` sets it to the run directory); unset, nothing is checked.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from infinity.config.sections import Config, headroom_bytes
from infinity.memory.plan import Plan
from infinity.memory.tier import Kind, Tier
from infinity.state.checkpoint import SAVED_KINDS, rank_file_bytes
from io_engine import format_size

CAP_IPC_LOCK = 14  # capability bit: mlock without RLIMIT_MEMLOCK
# a rank's index, RNG states and (rank 0) manifest, at most: fixed parts, per unit (its slots' names and shapes
# in the manifest) and per record (its index entry)
METADATA_FIXED, METADATA_PER_UNIT, METADATA_PER_RECORD = 32 << 10, 4 << 10, 256


class PreflightError(RuntimeError):
    """The machine cannot run this configuration; the message names the fix."""


@dataclass(frozen=True)
class Check:
    """One preflight check; a failed "error" stops the run, a failed "warning" slows it."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    level: str = "error"

    def line(self) -> str:
        mark = "ok  " if self.ok else ("FAIL" if self.level == "error" else "WARN")
        text = f"[{mark}] {self.name}: {self.detail}"
        return text + (f"\n         fix: {self.fix}" if not self.ok and self.fix else "")


def _fmt(n: float) -> str:
    return format_size(n, exact=False)


def existing_parent(path: str) -> Path:
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


# ---------------------------------------------------------------- nvme paths


def check_nvme_path(path: str, *, created_at_start: bool = False) -> Check:
    """Note [nvme paths]: whether `path` is (or, with `created_at_start`, can be created as) a writable
    directory for swap files."""
    name = f"nvme path {path}"
    fix_dir = "point nvme.paths at a directory on a fast local disk"
    where = existing_parent(path)
    if where.exists() and not where.is_dir():
        what = "is a file" if where == Path(path).resolve() else f"is below {where}, which is a file"
        return Check(name, False, f"{path} {what}, not a directory",
                     f"{fix_dir} (e.g. {path}.d), or move the file away")
    if where != Path(path).resolve() and not created_at_start:
        return Check(name, False, f"{path} does not exist or is not a directory",
                     f"create it (mkdir -p {path}) or {fix_dir}")
    if (e := write_error(where)) is not None:
        return Check(name, False, f"{where} is not writable ({e.strerror}): swap files cannot be created there",
                     f"make {where} writable, or create a writable directory on a fast local disk (mkdir -p) "
                     f"and point nvme.paths at it")
    note = " (created at start)" if where != Path(path).resolve() else ""
    return Check(name, True, f"a writable directory{note}")


def check_trace_dir(path: str) -> Check:
    """Whether the profiler's `profile.trace_dir` is (or can be created as) a writable directory: it is written
    at close, after the training, where a failure used to end a completed run with a traceback."""
    where = existing_parent(path)
    problem = (f"{where} is a file" if not where.is_dir()
               else (f"{where} is not writable ({e.strerror})" if (e := write_error(where)) is not None else None))
    return Check("profile directory", problem is None,
                 f"profile.trace_dir = {path!r}: {problem}" if problem else "a writable directory",
                 "set profile.trace_dir to a writable directory, or profile.enabled = false")


def write_error(directory: str | os.PathLike) -> OSError | None:
    """Why a file cannot be created in `directory` (a probe file made and removed), None when it can: the
    permission bits alone do not say (root, read-only mounts, immutable directories)."""
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".infinity-probe-"):
            return None
    except OSError as e:
        return e


def _raise_failed(checks: list[Check]) -> None:
    failed = [c for c in checks if not c.ok]
    if failed:
        raise PreflightError("\n".join(f"{c.detail}: {c.fix}" for c in failed))


def check_nvme_paths(paths: list[str], *, created_at_start: Collection[str] = ()) -> int:
    """Every swap path is a writable directory, or, if it is one of `created_at_start`, can be created as one
    (else PreflightError naming the path, the problem and the fix); returns the free bytes over their distinct
    filesystems."""
    _raise_failed([check_nvme_path(p, created_at_start=p in created_at_start) for p in paths])
    free, seen = 0, set()
    for path in paths:
        where = existing_parent(path)
        st = os.stat(where)
        if st.st_dev not in seen:
            seen.add(st.st_dev)
            free += shutil.disk_usage(where).free
    return free


def prepare_nvme_paths(paths: list[str], created_at_start: Collection[str]) -> None:
    """For a job that creates its own swap directory: check every path (PreflightError naming one that is a
    file, missing and not the job's own, or cannot be created), then create the job's own."""
    check_nvme_paths(paths, created_at_start=created_at_start)
    for path in created_at_start:
        os.makedirs(path, exist_ok=True)


# ---------------------------------------------------------------- disks


def checkpoint_bytes(plan: Plan, frozen_referenced: bool = False) -> int:
    """Bytes of one rank's files in one checkpoint (Note [checkpoint space]), at most: every saved kind of every
    sub-group of its update range, and its frozen parameters (in the compute dtype; none when they are all
    references to the pretrained files: Note [pretrained references]), placed as the rank file places them,
    plus the index, RNG states and manifest (a rank saves only its own partition of replicated kinds: less at
    stages 0-2)."""
    frozen_bytes = 0 if frozen_referenced else plan.compute_dtype.itemsize
    records = []
    for unit in plan.units:  # in the rank file's order: per unit, the saved kinds' sub-groups, then its frozen part
        records += [n * 4 for _ in SAVED_KINDS for n in unit.chunks(Kind.MASTER)]
        records += [n for n in [(unit.numel(Kind.PARAMS) - unit.written_params) * frozen_bytes] if n]
    return rank_file_bytes(records) + checkpoint_metadata(plan)


def checkpoint_metadata(plan: Plan) -> int:
    """Bytes of one rank's index, RNG states and manifest in one checkpoint, at most (Note [checkpoint space])."""
    records = sum(len(SAVED_KINDS) * len(unit.chunks(Kind.MASTER)) + 1 for unit in plan.units)  # (+ frozen / refs)
    return METADATA_FIXED + METADATA_PER_UNIT * len(plan.units) + METADATA_PER_RECORD * records


def checkpoints_kept(config: Config) -> int:
    """How many checkpoints are on disk at once while one is written (Note [checkpoint space])."""
    keep, saves = config.checkpoint.keep_last, config.checkpoint.saves
    if keep:
        return min(keep + 1, saves) if saves else keep + 1
    return max(1, saves)


FREE_DISK = "free disk on"  # the name of check_disks' space checks (the others: a swap path's own usability)


def check_disks(paths: list[str], *, nvme_bytes: int, local_world_size: int, checkpoint_dir: str = "",
                checkpoint_bytes: int = 0, checkpoints: int = 0, headroom: str = "0") -> tuple[list[Check], int]:
    """Each swap path is (or can be created as) a writable directory; each filesystem has room for its stripes
    of `nvme_bytes` per rank, plus `checkpoints` x `checkpoint_bytes` per rank when `checkpoint_dir` is on
    it, and keeps `headroom` (memory.headroom of its size: Note [headroom]) free. Returns the checks and the
    free bytes over the swap paths' distinct filesystems, less each one's headroom."""
    checks, free_total, seen = [], 0, {}  # st_dev -> [free, swap need, checkpoint need, names, headroom]
    stripe = nvme_bytes * local_world_size / max(1, len(paths))  # striping spreads every extent over the paths
    for path in paths:
        check = check_nvme_path(path, created_at_start=True)
        if not check.ok:
            checks.append(check)
            continue
        where = existing_parent(path)
        dev = os.stat(where).st_dev
        if dev not in seen:
            seen[dev] = _disk(where, headroom)
            free_total += max(0, seen[dev][0] - seen[dev][4])
        seen[dev][1] += int(stripe)
        seen[dev][3].append(path + (" (created at start)" if where != Path(path).resolve() else ""))
    ckpt_need = checkpoint_bytes * checkpoints * local_world_size
    if checkpoint_dir and ckpt_need:
        where = existing_parent(checkpoint_dir)
        dev = os.stat(where).st_dev
        if dev not in seen:
            seen[dev] = _disk(where, headroom)
        seen[dev][2] += ckpt_need
        seen[dev][3].append(f"checkpoints in {checkpoint_dir}")
    for free, swap, ckpt, names, margin in seen.values():
        parts = ([f"{_fmt(swap)} of swap"] if swap else []) + (
            [f"{checkpoints} checkpoint(s) of {_fmt(checkpoint_bytes)} per rank = {_fmt(ckpt)}"] if ckpt else [])
        fixes = (["add more nvme.paths (stripes) or keep more state in RAM (placement.* = \"host\" or policy = "
                  "\"auto\")"] if swap else []) + (
            ["keep fewer checkpoints ([checkpoint] keep_last = N keeps the newest N), or save checkpoints on "
             "another disk (checkpoint.dir; for `infinity train`, run.dir)"] if ckpt else [])
        keep = f", keeping {_fmt(margin)} free (memory.headroom)" if margin else ""
        checks.append(Check(f"{FREE_DISK} {', '.join(names)}", swap + ckpt + margin <= free,
                            f"{' + '.join(parts)} for {local_world_size} rank(s) needs {_fmt(swap + ckpt)}, "
                            f"{_fmt(free)} free{keep}", "free space there, " + ", or ".join(
                                fixes + (["lower memory.headroom"] if margin else []))))
    return checks, free_total


def _disk(where: Path, headroom: str) -> list:
    usage = shutil.disk_usage(where)
    return [usage.free, 0, 0, [], headroom_bytes(headroom, usage.total)]


# ---------------------------------------------------------------- locked memory


def _has_cap_ipc_lock() -> bool:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_IPC_LOCK & 1)
    except (OSError, ValueError):
        pass
    return False


def check_locked_memory(locked_bytes: int, local_world_size: int) -> Check:
    """mlock'ed (pinned) staging buffers against RLIMIT_MEMLOCK, unless CAP_IPC_LOCK lifts the limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    need = locked_bytes  # the limit is per process: one rank
    if soft == resource.RLIM_INFINITY or _has_cap_ipc_lock():
        why = "unlimited" if soft == resource.RLIM_INFINITY else "CAP_IPC_LOCK (not limited)"
        return Check("locked memory", True, f"{_fmt(need)} per rank to lock; limit {why}", level="warning")
    return Check("locked memory", need <= soft, f"{_fmt(need)} per rank of staging buffers to lock; "
                 f"RLIMIT_MEMLOCK is {_fmt(soft)}",
                 "raise the limit: `ulimit -l unlimited` in the launching shell (Docker: --ulimit memlock=-1; "
                 "systemd: LimitMEMLOCK=infinity; /etc/security/limits.conf: `* - memlock unlimited`). "
                 "Unlocked buffers work, with direct I/O up to ~2x slower", level="warning")


# ---------------------------------------------------------------- all of them


def ram_room(headroom: str) -> tuple[int, int]:
    """The RAM available now and the margin memory.headroom keeps of it (Note [headroom]): the free-RAM check's
    two figures."""
    vm = psutil.virtual_memory()
    return vm.available, headroom_bytes(headroom, vm.total)


def preflight(plan: Plan | None, plan_error: str | None, config: Config, *, local_world_size: int, cuda: bool,
              ram_per_rank: int = 0, device_per_rank: int = 0, frozen_referenced: bool = False,
              headroom: str = "0") -> list[Check]:
    """The checks `infinity estimate` prints and `initialize` refuses to start without (see `require`).
    `frozen_referenced`: checkpoints will refer to the pretrained files for every frozen parameter. `headroom`
    (the estimate passes memory.headroom: Note [headroom]): the RAM and disk a plan must leave unused; `initialize`
    starts a run that fits without it."""
    checks = [Check("placement fits the budgets", plan is not None, "yes" if plan else (plan_error or "no plan"),
                    "see above: change [placement] or [memory] as it says")]
    if plan is None:
        return checks
    state = plan.state_bytes()
    ram = ram_per_rank or sum(state[Tier.HOST].values()) + plan.working.get(Tier.HOST, 0) + (
        0 if cuda else sum(state[Tier.DEVICE].values()) + plan.working.get(Tier.DEVICE, 0))
    available, margin = ram_room(headroom)  # Note [headroom]
    checks.append(Check("free RAM", ram * local_world_size + margin <= available,
                        f"{_fmt(ram * local_world_size)} for {local_world_size} rank(s), {_fmt(available)} available"
                        + (f", keeping {_fmt(margin)} free (memory.headroom)" if margin else ""),
                        ("lower memory.headroom, or " if margin else "") + "move state to NVMe (placement.optimizer "
                        "/ grads / params = \"nvme\", or policy = \"auto\" "
                        "with a smaller memory.host_budget), run fewer ranks per node, or lower the batch size"))
    if cuda:
        free, _total = torch.cuda.mem_get_info()
        checks.append(Check("free GPU memory", device_per_rank <= free,
                            f"{_fmt(device_per_rank)} per rank, {_fmt(free)} free",
                            "move state off the GPU (placement.* = \"host\" / \"nvme\", or policy = \"auto\"), "
                            "lower prefetch.units_ahead, or lower the batch size"))
    paths = list(config.nvme.paths) if plan.uses(Tier.NVME) else []
    ckpt_dir = config.checkpoint.dir
    if paths or ckpt_dir:
        disk, _ = check_disks(paths, nvme_bytes=sum(state[Tier.NVME].values()), local_world_size=local_world_size,
                              checkpoint_dir=ckpt_dir, checkpoint_bytes=checkpoint_bytes(plan, frozen_referenced),
                              checkpoints=checkpoints_kept(config), headroom=headroom)
        checks += disk
    if plan.uses(Tier.NVME):
        # the host working terms are the pinned / mlock'ed staging (Note [working memory] in memory/traffic.py)
        checks.append(check_locked_memory(plan.working.get(Tier.HOST, 0), local_world_size))
    return checks


def require(checks: list[Check]) -> None:
    """Raise PreflightError listing every failed error-level check and its fix (for `initialize`)."""
    failed = [c for c in checks if not c.ok and c.level == "error"]
    if failed:
        raise PreflightError("the run cannot start:\n" + "\n".join(c.line() for c in failed))
