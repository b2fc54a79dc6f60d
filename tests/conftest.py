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


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    """One link-rate / runtime-RSS cache per test module (`INFINITY_CACHE_DIR`): the runtime RSS probe of
    an estimate runs once per module, and no test reads or writes the user's own cache."""
    mp = pytest.MonkeyPatch()
    mp.setenv("INFINITY_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()
