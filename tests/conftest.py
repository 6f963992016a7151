"""Test-wide fixtures: CUDA tests run on a non-default stream (kernels must use the current
stream, not the legacy default one)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


def _share_the_cores_between_xdist_workers() -> None:
    """Under pytest-xdist each worker process takes an equal share of the cores for torch's CPU
    threads: by default every worker starts one OpenMP thread per core, and with 8 workers on a
    16-core machine 128 threads (spinning between parallel regions) compete for 16 cores. Tests
    that need a thread count set their own."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores_between_xdist_workers()


@pytest.fixture(autouse=True)
def _cuda_tests_on_a_side_stream(request):
    callspec = getattr(request.node, "callspec", None)
    on_cuda = callspec is not None and callspec.params.get("device") == "cuda"
    if on_cuda and torch.cuda.is_available():
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()
    else:
        yield


@pytest.fixture(autouse=True)
def _cuda_cache_released_between_tests_under_xdist():
    """Under pytest-xdist, after a test that left more than 1 GiB in torch's CUDA caching allocator,
    the cached blocks go back to the driver: a worker that ran a large test would otherwise keep them
    (one held 65 GiB of an H100), and a test that sizes its work by the free memory in another
    worker ran out of it."""
    yield
    if (os.environ.get("PYTEST_XDIST_WORKER") and torch.cuda.is_available() and torch.cuda.is_initialized()
            and torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > 2 ** 30):
        torch.cuda.empty_cache()


_TIMES = os.environ.get("FT_TEST_TIMES")


def pytest_runtest_logreport(report):
    """With FT_TEST_TIMES=<file>, each test's call time is appended to it as it finishes (under
    pytest-xdist too), so a run cut off by a time limit still says which tests took its time
    (benchmarks/gpu_check.sh prints the slowest)."""
    # Under xdist the controller gets every worker's reports: the workers themselves write nothing.
    if _TIMES and report.when == "call" and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(_TIMES, "a") as f:
            f.write(f"{report.duration:.2f} {report.nodeid}\n")
