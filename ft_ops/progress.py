"""Progress output of the long host-side steps (allocating and filling the host pool): a tqdm bar on
a terminal (it redraws in place and clears itself when done), nothing in between on a pipe or a log
file, and one closing line either way, so a log gets one line per step instead of carriage returns."""
import sys
from typing import Iterable, Optional

from tqdm.auto import tqdm


def bar(iterable: Iterable, desc: str, enabled: bool, total: Optional[int] = None, unit: str = "it"):
    """`iterable`, with a bar on a terminal when `enabled` (disable=None: tqdm turns itself off
    where stderr is not a terminal)."""
    return tqdm(iterable, desc=f"[freetoken] {desc}", total=total, unit=unit, leave=False, file=sys.stderr,
                disable=None if enabled else True, dynamic_ncols=True)


def done(message: str, enabled: bool) -> None:
    """The closing line of a step, on stderr."""
    if enabled:
        print(f"[freetoken] {message}", file=sys.stderr, flush=True)
