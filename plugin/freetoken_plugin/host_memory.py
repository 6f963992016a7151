"""The host memory a conversion needs, checked against what the machine has before any of it is
taken: a host pool larger than the memory available would fail part way through filling it (a
pinned allocation error, or the kernel's out-of-memory killer for unpinned memory), after minutes."""
from typing import Optional

from ft_ops import formats
from ft_ops.slot_pool import ExpertShape, human_bytes


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostMemoryError(MemoryError):
    """The host pool (and what a conversion holds beside it) exceeds the host memory available."""


def check_host_pool_fits(shape: ExpertShape, extra_bytes: int, fp8_hint: str, fp8_extra_bytes: int) -> None:
    """Refuses a host pool of `shape` when it and `extra_bytes` (what the conversion holds beside
    it) exceed MemAvailable, saying how much each takes and, where the experts are float and their
    block-FP8 pool with `fp8_extra_bytes` beside it (what the caller's quantizing route holds)
    would fit, `fp8_hint` (how to ask for it)."""
    available = available_host_bytes()
    pool = shape.expert_bytes * shape.layers * shape.experts
    if available is None or pool + extra_bytes <= available:
        return
    what = (f"the host pool needs {human_bytes(pool)} ({shape.layers} MoE layers of {shape.experts} {shape.format} "
            f"experts{f', and {human_bytes(extra_bytes)} beside it while filling' if extra_bytes else ''}) and this "
            f"machine has {human_bytes(available)} of host memory available")
    if shape.format == formats.DENSE:
        fp8 = ExpertShape(shape.layers, shape.experts, shape.hidden, shape.intermediate, shape.dtype, shape.bias,
                          formats.FP8, shape.gated)
        fp8_pool = fp8.expert_bytes * shape.layers * shape.experts
        if fp8_pool + fp8_extra_bytes <= available:
            raise HostMemoryError(f"{what}: {fp8_hint} ({human_bytes(fp8_pool)}, block-FP8 as transformers "
                                  "quantizes) fits")
    raise HostMemoryError(f"{what}: free host memory, or run the model on a machine with more")
