"""What `infinity train` shows while it runs: the progress line, the overlap efficiency, peak RSS."""

from __future__ import annotations

import resource
import sys
import time


class Progress:
    """One status line: redrawn in place on a terminal, printed every `every` steps otherwise."""

    def __init__(self, total: int, every: int, enabled: bool, stream=None, first_step: int = 0, last: bool = False):
        self.total, self.every, self.enabled = total, every, enabled
        self.last = enabled or last  # the final line: printed by `--quiet` too (rank 0's)
        self.first_step = first_step  # steps done before this process started (a resumed run)
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.start = time.perf_counter()
        self._closed = False

    def update(self, step: int, loss: float, tokens_per_s: float, overlap: float | None) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(1, step - self.first_step) * (self.total - step)
        width = 24
        filled = int(width * step / self.total)
        line = (f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * filled}{'.' * (width - filled)}] "
                f"loss {loss:.4f}  {tokens_per_s:,.0f} tok/s  overlap {'-' if overlap is None else f'{overlap:.0%}'}"
                f"  {_clock(elapsed)}<{_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + "\033[K")
            self.stream.flush()
        elif step % self.every == 0 or step == self.total or step == self.first_step + 1:
            print(line, file=self.stream, flush=True)

    def note(self, text: str) -> None:
        if self.enabled:
            print(("\n" if self.tty and not self._closed else "") + text, file=self.stream, flush=True)

    def final(self, text: str) -> None:
        """The run's last line (its result and where it is), which even a quiet run prints."""
        if self.last:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty and not self._closed:
            self.stream.write("\n")
            self.stream.flush()
        self._closed = True


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}:{seconds % 60:02d}"
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def overlap_efficiency(engine) -> float | None:
    """The overlap efficiency (compute time / step time, 0..1) of the latest profiled step, when the engine
    has a profiler (`infinity.profile`), else None. Only the last step is summarized: summarizing every
    step each time would cost more the longer the run."""
    profiler = getattr(engine, "profiler", None)
    if profiler is None or not getattr(profiler, "enabled", True):
        return None
    try:
        if hasattr(profiler, "steps") and hasattr(profiler, "spans"):
            from infinity.profile import summarize
            last = profiler.steps()[-1:]
            if not last:
                return None
            spans = [s for s in profiler.spans() if s.end >= last[0].begin]
            summary = summarize(spans, last)
        else:
            summary = profiler.summary()
    except Exception:  # noqa: BLE001 - a profiler with nothing recorded yet must not stop training
        return None
    if not isinstance(summary, dict):
        return None
    steps = summary.get("steps") or []
    for source in (steps[-1] if steps else {}, summary.get("median") or {}, summary):
        value = source.get("overlap_efficiency") if isinstance(source, dict) else None
        if isinstance(value, (int, float)):
            return float(value)
    return None


def peak_rss_bytes() -> int:
    """This process's peak resident set size: VmHWM of /proc/self/status on Linux (Note [peak RSS of a
    spawned process]), getrusage's ru_maxrss elsewhere."""
    # Note [peak RSS of a spawned process]: Linux keeps ru_maxrss across execve, and a child started with
    # vfork + exec (what subprocess does) takes the *parent's* peak as its own starting value: `infinity
    # train` launched from a 600 MiB pytest process reported a 604 MiB peak for a job whose own peak was
    # 450 MiB. VmHWM is the high-water mark of this process's own address space, new at exec.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1024 if sys.platform != "darwin" else 1)

