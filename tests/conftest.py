"""Test-wide fixtures: CUDA tests run on a non-default stream (kernels must use the current
stream, not the legacy default one)."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


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
