"""The host-to-device link's rate by copy size and copy streams, against one 512 MiB copy (the link
bound's rate in `freetoken bench` and profile_prefill.py): how much a prompt that sends a layer as
many runs of experts (a warm cache) loses to per-copy costs.

    python3 benchmarks/bench_link.py          # about a minute on an H200 machine

Copies of `chunk` bytes back to back from a 1 GiB pinned buffer into a device buffer, on one stream
or alternating between two; then the copy pattern of
a warm 48-layer Qwen3-30B-A3B prompt: runs of 1-12 experts' w13 (6.3 MB each) and w2 (3.1 MB each)
rows from scattered places of a 24 GiB pinned pool into scattered slots of a 16 GiB device pool,
issued per copy on one stream, on two in turn or by bytes, and as one cudaMemcpyBatchAsync a
stream (where the CUDA runtime has it; async_layer_copy's way since 2026-12-06: two streams by
bytes, a batch each);
then expert-sized copies while 1, 6 or 16 CPU threads read other host memory (as the CPU share's
row threads read the host pool while the link copies); last, 512 MiB and 18 MiB copies while the
GPU computes on another stream (bf16 GEMMs, an 8k-token attention, device-to-device copies: what a
streamed prompt runs beside its copies), each against the same copies on an idle GPU."""
import argparse
import ctypes
import glob
import os
import random
import statistics
import threading
import time

import torch

from common import print_table, write_report

GiB = 1 << 30
W13, W2 = 6291456, 3145728  # one bf16 Qwen3-30B-A3B expert's rows (H 2048, I 768)


def rate_gbps(copies, streams: int, reps: int = 4, by_bytes: bool = False, batch_async=None) -> float:
    """GB/s of `copies` ((dst, src) pairs of equal-size tensors) issued back to back over `streams`
    streams, in turn (or, with by_bytes, each to the stream with fewer bytes queued so far), median
    of reps - 1 timed runs after one untimed. With `batch_async` (_memcpy_batch_async()), each
    stream's copies go as one cudaMemcpyBatchAsync instead of one cudaMemcpyAsync a copy. The copies
    run on streams of their own (the batch call refuses the legacy default stream), timed from the
    current one."""
    here = torch.cuda.current_stream()
    ss = [torch.cuda.Stream() for _ in range(streams)]
    order, queued = [], [0] * streams  # each copy's stream, in issue order
    for i, (dst, src) in enumerate(copies):
        s = min(range(streams), key=queued.__getitem__) if by_bytes else i % streams
        queued[s] += src.numel() * src.element_size()
        order.append(s)
    batches = ([_batch_arguments([c for c, s in zip(copies, order) if s == k]) for k in range(streams)]
               if batch_async is not None else None)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for s in ss:
            s.wait_stream(here)
        if batches is not None:
            for stream, batch in zip(ss, batches):
                err = batch_async(*batch, ctypes.c_void_p(stream.cuda_stream))
                if err != 0:
                    raise RuntimeError(f"cudaMemcpyBatchAsync failed with CUDA error {err}")
        else:
            for s, (dst, src) in zip(order, copies):
                with torch.cuda.stream(ss[s]):
                    dst.copy_(src, non_blocking=True)
        for s in ss:
            here.wait_stream(s)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sum(queued) / statistics.median(times[1:]) / 1e9


def chunk_rows():
    total = GiB
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    host.fill_(1)
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    one = rate_gbps([(dev[: 512 << 20], host[: 512 << 20])], 1)
    rows = []
    for mb in (512, 18, 6, 3):
        chunk = mb << 20
        copies = [(dev[o:o + chunk], host[o:o + chunk]) for o in range(0, total - chunk + 1, chunk)]
        for streams in (1, 2):
            r = rate_gbps(copies, streams)
            rows.append(dict(case=f"{mb} MiB copies", streams=streams, GBps=round(r, 2), vs_one_512MiB_copy=round(r / one, 3)))
    del host, dev
    return rows, one


class _MemcpyAttributes(ctypes.Structure):
    """cudaMemcpyAttributes (driver_types.h): the source access order, two location hints (type, id)
    and the flags."""
    _fields_ = [("src_access_order", ctypes.c_int), ("src_loc_type", ctypes.c_int), ("src_loc_id", ctypes.c_int),
                ("dst_loc_type", ctypes.c_int), ("dst_loc_id", ctypes.c_int), ("flags", ctypes.c_uint)]


def _memcpy_batch_async():
    """cudaMemcpyBatchAsync of the CUDA runtime torch loaded (CUDA 13's signature: no failure
    index), or None where that runtime has none."""
    # The soname finds the copy torch's CUDA library already loaded; else the pip packages' paths.
    site = os.path.join(os.path.dirname(torch.__file__), "..", "nvidia")
    names = ["libcudart.so.13"] + glob.glob(os.path.join(site, "*", "lib", "libcudart.so.13"))
    for name in names:
        try:
            fn = ctypes.CDLL(name).cudaMemcpyBatchAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
                       ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes),
                       ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t, ctypes.c_void_p]
        return fn
    return None


def _batch_arguments(part):
    """cudaMemcpyBatchAsync's arguments but the stream for the (dst, src) pairs of `part`: one set
    of attributes (sources read in stream order) for all."""
    n = len(part)
    dsts = (ctypes.c_void_p * n)(*[d.data_ptr() for d, _ in part])
    srcs = (ctypes.c_void_p * n)(*[s.data_ptr() for _, s in part])
    sizes = (ctypes.c_size_t * n)(*[s.numel() * s.element_size() for _, s in part])
    attrs = (_MemcpyAttributes * 1)(_MemcpyAttributes(src_access_order=1))  # cudaMemcpySrcAccessOrderStream
    return dsts, srcs, sizes, n, attrs, (ctypes.c_size_t * 1)(0), 1


def warm_prompt_rows(one: float):
    rng = random.Random(0)
    host = torch.empty(24 * GiB, dtype=torch.uint8).pin_memory()
    host.fill_(1)
    pool = torch.empty(16 * GiB, dtype=torch.uint8, device="cuda")
    copies, total = [], 0
    while total < 20 * GiB:
        k = min(12, 1 + int(rng.expovariate(1 / 2.75)))  # experts per run (mean ~3.7, as profiled)
        for row in (W13, W2):
            nbytes = k * row
            src = rng.randrange(0, (host.numel() - nbytes) // row) * row
            dst = rng.randrange(0, (pool.numel() - nbytes) // row) * row
            copies.append((pool[dst:dst + nbytes], host[src:src + nbytes]))
            total += nbytes
    rows = []
    # Two streams: gate_up and down of each run in turn (each bank's copies on one stream: two thirds
    # of the bytes on the first), or each copy to the stream with fewer bytes queued (both busy to
    # the end).
    for streams, by_bytes in ((1, False), (2, False), (2, True)):
        r = rate_gbps(copies, streams, reps=2, by_bytes=by_bytes)
        rows.append(dict(case=f"warm prompt: {len(copies)} runs, mean {total / len(copies) / 1e6:.1f} MB"
                              + (", by bytes" if by_bytes else ", in turn" if streams > 1 else ""),
                         streams=streams, GBps=round(r, 2), vs_one_512MiB_copy=round(r / one, 3)))
    # The same copies as one cudaMemcpyBatchAsync a stream, as async_layer_copy submits them: fewer
    # submissions, which the driver pipelines better.
    batch_async = _memcpy_batch_async()
    for streams in ((1, 2) if batch_async is not None else ()):
        r = rate_gbps(copies, streams, reps=2, by_bytes=True, batch_async=batch_async)
        rows.append(dict(case=f"warm prompt: {len(copies)} runs, one cudaMemcpyBatchAsync a stream",
                         streams=streams, GBps=round(r, 2), vs_one_512MiB_copy=round(r / one, 3)))
    return rows


def cpu_read_rows(one: float):
    """60 one-expert copies (9 MiB) while a thread reads other pinned host memory, one expert at a
    time, on `threads` torch threads (bf16 sums: reads only)."""
    expert = W13 + W2
    host = torch.empty(6 * GiB, dtype=torch.uint8).pin_memory()
    host.fill_(1)
    dev = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    copies = [(dev[o:o + expert], host[o:o + expert]) for o in (j * expert for j in range(60))]
    region = host[4 * GiB:].view(torch.bfloat16)
    n = expert // 2
    rows = [dict(case="9 MiB copies, CPU idle", streams=1, GBps=round(rate_gbps(copies, 1), 2))]
    before = torch.get_num_threads()
    for threads in (1, 6, 16):
        stop, read = threading.Event(), {}

        def reader():
            torch.set_num_threads(threads)
            i, nbytes, t0 = 0, 0, time.perf_counter()
            while not stop.is_set():
                off = (i * n) % (region.numel() - n)
                region[off:off + n].sum()
                i, nbytes = i + 1, nbytes + expert
            read["GBps"] = nbytes / (time.perf_counter() - t0) / 1e9

        worker = threading.Thread(target=reader)
        worker.start()
        time.sleep(0.3)
        r = rate_gbps(copies, 1)
        stop.set()
        worker.join()
        rows.append(dict(case=f"9 MiB copies, {threads} CPU threads reading {read['GBps']:.1f} GB/s", streams=1,
                         GBps=round(r, 2)))
    torch.set_num_threads(before)
    for row in rows:
        row["vs_one_512MiB_copy"] = round(row["GBps"] / one, 3)
    return rows


def busy_gpu_rows(one: float):
    """1 GiB of copies (one 512 MiB pair, or 18 MiB runs) on one stream while another stream runs
    `work` back to back for longer than the copies take, against the same copies on an idle GPU."""
    host = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    host.fill_(1)
    dev = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    patterns = {mb: [(dev[o:o + (mb << 20)], host[o:o + (mb << 20)]) for o in range(0, GiB - (mb << 20) + 1, mb << 20)]
                for mb in (512, 18)}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    big = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
    works = {
        "bf16 GEMMs 8192^3": lambda: torch.mm(a, a),
        "attention, 8k tokens, causal": lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True),
        "device-to-device copies, 1 GiB": lambda: big[GiB:].copy_(big[:GiB]),
    }
    side = torch.cuda.Stream()
    rows = []

    def timed(copies, work=None, launches=0):
        """GB/s of the copies; with work, also whether the work outlasted them (it must, or the
        copies' end ran on an idle GPU)."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        work_end = torch.cuda.Event(enable_timing=True)
        if work is not None:
            with torch.cuda.stream(side):
                for _ in range(launches):
                    work()
                work_end.record()
        start.record()
        for dst, src in copies:
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        covered = work is None or end.elapsed_time(work_end) > 0
        return sum(s.numel() for _, s in copies) / (start.elapsed_time(end) / 1e3) / 1e9, covered

    def median_rate(copies, work=None, launches=0):
        timed(copies, work, launches)  # untimed: the first run of a pattern
        runs = [timed(copies, work, launches) for _ in range(3)]
        return statistics.median(r for r, _ in runs), all(c for _, c in runs)

    for mb, copies in patterns.items():
        idle, _ = median_rate(copies)
        rows.append(dict(case=f"{mb} MiB copies, GPU idle", streams=1, GBps=round(idle, 2), vs_idle=1.0))
        copy_s = GiB / (idle * 1e9)
        for name, work in works.items():
            work()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                work()
            torch.cuda.synchronize()
            launches = int(2 * copy_s / ((time.perf_counter() - t0) / 5)) + 2
            r, covered = median_rate(copies, work, launches)
            while not covered and launches < 10000:  # the work slowed the copies past it: more work
                launches *= 2
                r, covered = median_rate(copies, work, launches)
            rows.append(dict(case=f"{mb} MiB copies beside {name}" + ("" if covered else " (work ended first)"),
                             streams=1, GBps=round(r, 2), vs_idle=round(r / idle, 3)))
    del host, dev, big
    for row in rows:
        row["vs_one_512MiB_copy"] = round(row["GBps"] / one, 3)
    return rows


def main():
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_link.py measures the host-to-device link: run it on a machine with a GPU")
    rows, one = chunk_rows()
    rows += warm_prompt_rows(one)
    rows += cpu_read_rows(one)
    rows += busy_gpu_rows(one)
    write_report("link", rows, {"one_512MiB_copy_GBps": round(one, 2)})
    print_table(f"host -> device copies against one 512 MiB copy ({one:.2f} GB/s); vs_idle: the same copies "
                "on an idle GPU", rows, ["case", "streams", "GBps", "vs_one_512MiB_copy", "vs_idle"])


if __name__ == "__main__":
    main()
