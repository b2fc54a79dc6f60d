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
    the user's next plan then used). A test of the cache itself sets a directory of its own."""
    import tempfile
    os.environ.setdefault("INFINITY_SUITE_CACHE", tempfile.mkdtemp(prefix="infinity-suite-cache-"))
    os.environ["INFINITY_CACHE_DIR"] = os.environ["INFINITY_SUITE_CACHE"]
