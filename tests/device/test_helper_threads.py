"""Note [helper threads on a CPU device]: a helper thread bound to the CPU runs its kernels single-threaded,
and nothing else changes: the caller's thread count, and the count threads started later begin with."""

import threading

import torch

from infinity.device.streams import bind_thread


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_a_bound_helper_thread_runs_single_threaded_and_leaves_the_process_setting():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def helper():
            bind_thread(torch.device("cpu"))
            x = torch.randn(1 << 16)
            return torch.get_num_threads(), float((x * 2).sum() / x.sum())  # kernels still run

        helper_threads, ratio = _in_thread(helper)
        assert helper_threads == 1 and abs(ratio - 2.0) < 1e-4
        assert torch.get_num_threads() == 2  # the caller's team is untouched
        assert _in_thread(torch.get_num_threads) == 2  # a thread started later begins at the process setting
    finally:
        torch.set_num_threads(before)
