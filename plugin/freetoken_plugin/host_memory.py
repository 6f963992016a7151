"""The host memory a conversion needs, checked against what the machine has before any of it is
taken: a host pool larger than the memory available would fail part way through filling it (a
pinned allocation error, or the kernel's out-of-memory killer for unpinned memory), after minutes."""
import os
from typing import Optional

from ft_ops import formats
from ft_ops.slot_pool import ExpertShape, human_bytes


def available_host_bytes() -> Optional[int]:
    """The host memory this process can still take: MemAvailable of /proc/meminfo, or less where the
    process's memory cgroup (a container's limit, a Slurm job's) leaves less; None where neither is
    known. MemAvailable alone reports the whole machine, so inside a container limited below it a
    pool that "fits" would be killed by the cgroup's out-of-memory killer part way through filling."""
    known = [b for b in (_meminfo_available(), cgroup_headroom_bytes()) if b is not None]
    return min(known) if known else None


def _meminfo_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


# cgroup v1 writes "no limit" as the largest page-aligned int64; anything this large is no limit.
_NO_LIMIT = 1 << 60


def cgroup_headroom_bytes(root: str = "/sys/fs/cgroup", membership: str = "/proc/self/cgroup") -> Optional[int]:
    """What the process's memory cgroup and its ancestors still allow: the tightest of (limit - usage
    + inactive file cache, which the kernel reclaims before it kills) over the cgroups from the
    process's own up to the mount's root, under cgroup v2 (memory.max) or v1 (the memory
    controller's memory.limit_in_bytes); None where none has a limit or the files are not there."""
    try:
        with open(membership) as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for hierarchy, controllers, path in (line for line in lines if len(line) == 3):
        if hierarchy == "0" and controllers == "" and os.path.exists(os.path.join(root, "cgroup.controllers")):
            files = ("memory.max", "memory.current", "inactive_file")  # v2: one unified hierarchy
            base = root
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
            base = os.path.join(root, "memory")
        else:
            continue
        headroom = _tightest_headroom(base, path, *files)
        if headroom is not None:
            return headroom
    return None


def _tightest_headroom(base: str, path: str, limit_file: str, usage_file: str, inactive_key: str) -> Optional[int]:
    # Inside a container with its own cgroup namespace the process's path is "/" and `base` is its
    # cgroup; elsewhere the path leads from `base` to it. Walk up from there to `base`.
    base = os.path.normpath(base)
    directory = os.path.normpath(os.path.join(base, path.lstrip("/")))
    if not os.path.isdir(directory) or os.path.commonpath([directory, base]) != base:
        directory = base  # a path outside the mount ("/../.." without a cgroup namespace) or not there
    tightest = None
    while True:
        limit, usage = _read_int(os.path.join(directory, limit_file)), _read_int(os.path.join(directory, usage_file))
        if limit is not None and limit < _NO_LIMIT and usage is not None:
            headroom = max(0, limit - usage + _inactive_file(os.path.join(directory, "memory.stat"), inactive_key))
            tightest = headroom if tightest is None else min(tightest, headroom)
        if directory == base:
            return tightest
        directory = os.path.dirname(directory)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2 writes "max" for no limit


def _inactive_file(stat_path: str, key: str) -> int:
    try:
        with open(stat_path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


class HostMemoryError(MemoryError):
    """The host pool (and what a conversion holds beside it) exceeds the host memory available."""


def check_host_pool_fits(shape: ExpertShape, extra_bytes: int, fp8_hint: str, fp8_extra_bytes: int) -> None:
    """Refuses a host pool of `shape` when it and `extra_bytes` (what the conversion holds beside
    it) exceed MemAvailable, saying how much each takes and, where the experts are float and their
    block-FP8 pool (else their int4 pool, quantize="int4") with `fp8_extra_bytes` beside it (what the
    caller's quantizing route holds) would fit, `fp8_hint` (how to ask for it, with 'fp8'; 'int4'
    takes its place for the int4 pool)."""
    available = available_host_bytes()
    pool = shape.expert_bytes * shape.layers * shape.experts
    if available is None or pool + extra_bytes <= available:
        return
    what = (f"the host pool needs {human_bytes(pool)} ({shape.layers} MoE layers of {shape.experts} {shape.format} "
            f"experts{f', and {human_bytes(extra_bytes)} beside it while filling' if extra_bytes else ''}) and this "
            f"machine has {human_bytes(available)} of host memory available")
    if shape.format == formats.DENSE:
        int4_groups = formats.int4_groups_dividing(shape.hidden, shape.intermediate)
        routes = [(formats.FP8, 0, "block-FP8 as transformers quantizes")]
        if shape.gated and int4_groups:  # quantize="int4"'s group
            routes.append((formats.INT4, int4_groups[0], f"int4 in groups of {int4_groups[0]}, rounded to nearest"))
        for fmt, group, how in routes:
            quantized = ExpertShape(shape.layers, shape.experts, shape.hidden, shape.intermediate, shape.dtype,
                                    shape.bias, fmt, shape.gated, group=group)
            quantized_pool = quantized.expert_bytes * shape.layers * shape.experts
            if quantized_pool + fp8_extra_bytes <= available:
                hint = fp8_hint.replace("'fp8'", f"'{fmt}'")
                raise HostMemoryError(f"{what}: {hint} ({human_bytes(quantized_pool)}, {how}) fits")
    raise HostMemoryError(f"{what}: free host memory, or run the model on a machine with more")
