"""Which spilled blocks the tiers take: a block is admitted on its N-th spill.

With N = 1 every block is admitted. With N = 2 a block must be evicted from
a GPU twice -- it was needed again after its first eviction -- before it
takes a slot, which keeps one-off prompts from flushing reused prefixes.
The spill counts of waiting blocks are remembered in a bounded LRU
(``window`` hashes); a block forgotten there starts counting again.
"""

from __future__ import annotations

from collections import OrderedDict


class AdmissionFilter:
    """Counts spills per block hash; :meth:`admit` says whether this spill is the admitting one."""

    def __init__(self, admit_after: int, window: int) -> None:
        if admit_after < 1 or window < 1:
            raise ValueError(f"admit_after and window must be >= 1, got {admit_after} and {window}")
        self.admit_after = admit_after
        self.window = window
        self._seen: OrderedDict[int, int] = OrderedDict()
        self.rejected = 0

    def admit(self, block_hash: int) -> bool:
        if self.admit_after == 1:
            return True
        count = self._seen.pop(block_hash, 0) + 1
        if count >= self.admit_after:
            return True
        self._seen[block_hash] = count
        if len(self._seen) > self.window:
            self._seen.popitem(last=False)
        self.rejected += 1
        return False

    def __len__(self) -> int:
        return len(self._seen)
