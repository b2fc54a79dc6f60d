"""Note [peak RSS of a spawned process]: a job's reported peak is its own, not its launcher's."""

import subprocess
import sys

from infinity.job.progress import peak_rss_bytes


def test_a_spawned_process_does_not_inherit_its_parents_peak():
    ballast = bytearray(400 * 2**20)  # this (parent) process's peak: at least 400 MiB resident
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    assert peak_rss_bytes() >= 400 * 2**20
    code = "from infinity.job.progress import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    # the child only imports infinity (torch included): far under the parent's 400 MiB of ballast
    assert 0 < child < 350 * 2**20, child >> 20
    del ballast
