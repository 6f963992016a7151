"""The slot pool's eviction policies, as `dedup_and_admit` and `async_layer_copy` take them (the
`policy` argument). docs/ops.md states both; ft_ops/eviction.py compares them offline.

- "lru" (0): victims in ascending (last_use, slot); streamed rows and the resident rows a stream
  keeps are stamped `now`.
- "opportunity" (1): the same stamps on decode hits and admissions, victims by the decode turns
  of their layer they missed (one call per layer per token), the most missed first, and within
  as many missed turns the most recently used first (its layer's next turn is the farthest). A
  stream stamps the rows it writes STREAMED (1) and leaves resident rows' stamps alone, so a
  prompt does not make its layers look recent. The pool's clock starts at 1.
"""
LRU, OPPORTUNITY = 0, 1
POLICIES = {"lru": LRU, "opportunity": OPPORTUNITY}
STREAMED = 1  # the stamp of a streamed row under OPPORTUNITY


def policy_id(name: str) -> int:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name]


def victim_key(last_use: int, now: int, layers: int, policy: int) -> int:
    """The order victims are taken in (ascending, then by slot). LRU: the stamp. OPPORTUNITY, with
    a = now - 1 - last_use: now - L floor(a / L) + (a mod L); free slots (0) and streamed rows (1)
    first."""
    if policy == LRU or last_use <= STREAMED:
        return last_use
    a = now - 1 - last_use
    return now - layers * (a // layers) + a % layers
