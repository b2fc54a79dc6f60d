import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))  # the shared helpers: reference, dist_utils, ...


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    """The suite's own cache directory for the link rates and the runtime probe (SUITE_CACHE), INFINITY_CACHE_DIR
    for the whole session and every process a test starts: the probe (a fresh process importing torch, and
    transformers / PEFT for a Hugging Face job) runs once per package set in the suite, and no test reads or writes
    the user's cache (a benchmark's smoke test once stored link rates measured on a pytest directory there, which
    the user's next plan then used). A test of the cache itself sets a directory of its own.

    The link rates of this machine and its temp disk (where every test's NVMe directory is) are pinned there, typical
    of a 2-core CPU machine, before any worker starts: the plans a test is shown are the fastest, and rates measured
    while the suite (or the other worker) runs change with the load. With one run's (84 GFLOP/s, a 2.5 / 4.3 GB/s
    disk: the disk hidden behind slow compute) static all-NVMe plans outranked the plan a test expected, and CI
    failed on 2026-11-29. A test of the measurement sets a cache directory of its own or remeasures."""
    import tempfile
    first = "INFINITY_SUITE_CACHE" not in os.environ  # (the controller: xdist's workers inherit its directory)
    if first:
        os.environ["INFINITY_SUITE_CACHE"] = tempfile.mkdtemp(prefix="infinity-suite-cache-")
    os.environ["INFINITY_CACHE_DIR"] = os.environ["INFINITY_SUITE_CACHE"]
    if first:
        from infinity.machine.link_rates import store_rates
        from infinity.memory.cost_model import LinkRates
        store_rates(tempfile.gettempdir(), torch.device("cpu"), LinkRates(
            nvme_read=2.0e9, nvme_write=3.0e9, cpu_adam=1.6e9, device_adam=1.6e9, matmul_flops=1.2e11,
            memory_bw=3.0e10, source="pinned by the test suite (tests/conftest.py)"))
