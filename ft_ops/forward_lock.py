"""ForwardLock: one forward at a time through a runtime's pools.

A runtime's slot pool, streaming regions and counters are shared by every call: two forwards of
the same model in two threads (a chat server's request threads) would evict each other's experts
between an admission and its GEMM, or interleave two streamed passes, and compute wrong tokens.
The plugin holds this lock around each forward and each generate call of an offloaded model, so
such forwards take turns. Re-entrant (generate's forwards run inside generate's hold), counted per
thread (a release by a thread that holds nothing does nothing; generate releases down to the depth
it started from), and a deep copy of the runtime gets a lock of its own. The plugin releases in
`finally` blocks, so an exception or a KeyboardInterrupt in a forward leaves the lock free.
"""
import threading


class ForwardLock:
    def __init__(self):
        self._lock = threading.RLock()
        self._held = threading.local()

    def acquire(self) -> None:
        self._lock.acquire()
        self._held.depth = getattr(self._held, "depth", 0) + 1

    def release(self) -> None:
        depth = getattr(self._held, "depth", 0)
        if depth > 0:
            self._held.depth = depth - 1
            self._lock.release()

    def depth(self) -> int:
        """This thread's holds."""
        return getattr(self._held, "depth", 0)

    def release_to(self, depth: int) -> None:
        """Releases this thread's holds down to `depth`."""
        while self.depth() > depth:
            self.release()

    def __deepcopy__(self, memo):
        return ForwardLock()

    def __reduce__(self):
        return (ForwardLock, ())
