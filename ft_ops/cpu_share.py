"""CpuShare: a worker thread that computes, from the host pool, the decode pairs an admission left
to the CPU (fetch_fraction < 1, or a pool short of victims), while the device copies and computes
the rest. The device posts each call's share to a mailbox in pinned host memory and later waits for
the result on the device (ops cpu_share_submit / cpu_share_join): no host sync, and capturable, so
compiled decode runs it inside its CUDA graphs. src/common/cpu_share.h has the protocol.
"""
import weakref
from typing import Optional, Sequence, Union

import torch

from . import _extension, ops  # noqa: F401  (_extension loads the kernels)
from .activations import Activation, per_layer
from .slot_pool import HostPool

DEFAULT_TOKENS = 4096  # tokens a call can leave to the CPU (the mailbox's capacity)


def _close(session: int, device: torch.device) -> None:
    from . import _C

    if device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)  # queued submits and joins of this session have run
    _C.cpu_share_close(session)


class CpuShare:
    def __init__(self, host: HostPool, activation: Union[Activation, Sequence[Activation]], top_k: int, device,
                 tokens: int = DEFAULT_TOKENS):
        """`activation`: the expert function, or one per layer of the host pool."""
        from . import _C

        if tokens <= 0 or top_k <= 0:
            raise ValueError(f"CpuShare needs tokens > 0 and top_k > 0, got tokens={tokens}, top_k={top_k}")
        self.device = torch.device(device)
        dtype = host.shape.dtype
        nbytes = _C.cpu_share_mailbox_bytes(tokens, top_k, host.shape.hidden, dtype)
        # Pinned (and so mapped) for a CUDA producer; 128-byte aligned either way (the allocators
        # give at least 64: over-allocate and slice to the next 128).
        raw = torch.empty(nbytes + 128, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        offset = (-raw.data_ptr()) % 128
        self.mailbox = raw[offset:offset + nbytes]
        layer_functions = [a.function_args() for a in per_layer(activation, host.shape.layers)]
        self.session = _C.cpu_share_open(self.mailbox, host.w13, host.w2, host.b13, host.b2, host.w13_scale,
                                         host.w2_scale, layer_functions, tokens, top_k, dtype)
        self.tokens, self.top_k = tokens, top_k
        self._host, self._activation = host, activation  # a deep copy opens its own session over them
        self.seq = torch.zeros(1, dtype=torch.int64, device=self.device)  # jobs posted (on the device)
        # A static address, as the pool's state: compiled graphs update it in place every replay.
        torch._dynamo.mark_static_address(self.seq)
        # The worker thread stops when this object goes away (it holds the host banks), after the
        # device has run what it queued for it.
        self._closer = weakref.finalize(self, _close, self.session, self.device)
        if self.device.type == "cuda":
            # One call that posts nothing, eagerly: the kernels' first call resolves the mailbox's
            # device address, which must not happen inside a graph capture.
            none = torch.zeros(1, top_k, dtype=torch.int32, device=self.device)
            x = torch.zeros(1, host.shape.hidden, dtype=dtype, device=self.device)
            self.join(x, self.submit(0, x, none, none, none.float()))

    def __deepcopy__(self, memo):
        """A session of its own, over the copy's host pool: copied, the session number and mailbox
        would post into this session's worker, with colliding tickets (another copy's result)."""
        import copy

        return CpuShare(copy.deepcopy(self._host, memo), self._activation, self.top_k, self.device, self.tokens)

    def submit(self, layer: int, hidden: torch.Tensor, slot_ids: torch.Tensor, expert_ids: torch.Tensor,
               weights: torch.Tensor, stats: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Posts the pairs left at slot -1 (slot_ids int32 [T, K]) of expert_ids; returns the ticket."""
        return ops.cpu_share_submit(self.session, layer, hidden, slot_ids, expert_ids, weights, self.seq, stats)

    def join(self, out: torch.Tensor, ticket: torch.Tensor) -> torch.Tensor:
        """out + the job's result (waits for it on the device)."""
        return ops.cpu_share_join(self.session, out, ticket)

    def worker_counters(self):
        """(jobs computed, seconds the worker spent computing them)."""
        from . import _C

        return _C.cpu_share_worker_counters(self.session)

    def row_thread_counters(self) -> dict:
        """The worker's row threads since the session opened (as of its last job): calls split
        across the threads, their chunks, the chunks the worker ran itself (the rest ran on the
        helper threads), and the calls that found the helpers asleep and woke them."""
        from . import _C

        calls, chunks, worker_chunks, wakes = _C.cpu_share_row_thread_counters(self.session)
        return dict(split_calls=calls, chunks=chunks, worker_chunks=worker_chunks, wakes=wakes)

    def last_error(self) -> str:
        """The message of the last job that raised in the worker ("" if none)."""
        from . import _C

        return _C.cpu_share_last_error(self.session)

    def close(self) -> None:
        """Stops the worker, once the device has run the work queued for it (a graph that captured
        this session must not be replayed after)."""
        self._closer()
