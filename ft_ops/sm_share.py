"""GEMMs that leave the copy kernels' SMs to them.

A copy kernel that reads pinned host memory (copy_experts, async_layer_copy with skip_resident)
holds a few SMs for as long as the copy runs. The grouped prefill GEMM (CUTLASS, persistent CTAs
that fill an SM) cannot share an SM with a copy block, so the CTAs whose SMs the copy holds start
only when the copy ends and the pair serializes (docs/performance.md, overlap). torch's SM carveout
makes the matrix products launched under it leave that many SMs free; the prefill path sets it,
for its GEMM only, to the copy kernel's grid.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ._extension import LIMITS


def copy_kernel_sms(layer_copy: bool) -> int:
    """SMs the copy kernel takes: copy_experts' grid, or async_layer_copy's with skip_resident
    (layer_copy=True); 0 in a build without CUDA kernels."""
    return int(LIMITS["layer_copy_blocks" if layer_copy else "copy_blocks"])


def carveout_supported() -> bool:
    return hasattr(torch._C, "_set_sm_carveout_experimental") and hasattr(torch._C, "_get_sm_carveout_experimental")


@contextlib.contextmanager
def sms_left_to_copies(sms: int) -> Iterator[None]:
    """Matrix products launched inside leave `sms` SMs free (nothing changes for sms <= 0, for a
    carveout the caller set already, or on a torch without the setting); the previous setting is
    restored on exit. Eager mode only: it changes a process-wide setting of torch."""
    if sms <= 0 or not carveout_supported() or torch._C._get_sm_carveout_experimental() is not None:
        yield
        return
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(None)
