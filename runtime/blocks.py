"""Who owns the KV cache's blocks, and which full blocks hold a known prefix (automatic prefix caching).

Blocks are counted by reference, so that sequences can share the blocks of a common prefix. A
full block can be registered under its key: the hash chain of its tokens and every token before
it (key = SHA-256 of (the key of the block before, its tokens); the first block's "before" is
empty), as vLLM and nano-vllm identify blocks. A later prompt that starts with the same tokens finds those
blocks (`lookup`) and skips their prefill. Why a hash chain and not a radix tree: a block is
found by one dict lookup per block of the prompt, its key is built from the prompt alone, and
eviction is a queue of blocks, not a walk of a tree; what a tree adds (sharing partial blocks)
is worth less than a block of recomputed prefill. A cryptographic hash, not Python's 64-bit
hash(): a false hit (another prompt's keys and values read as this one's) needs a SHA-256
collision, not a 64-bit one, which a server's clients could craft.

A block with no owner is free. A registered one stays registered once free ("cached"): it can be
found again until a new block is needed and none is free unregistered; then the cached block
that was let go longest ago is evicted (its key forgotten) and handed out. So

    free (unregistered) + cached (registered, no owner) + in use (owned) = all blocks.

Owners never write into a registered block: keys are registered only for blocks whose tokens are
all written, and a sequence that reuses blocks writes its new tokens into blocks of its own.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def block_keys(tokens: Sequence[int], block_size: int, n_blocks: int, first: int = 0,
               before: bytes = b"") -> list[bytes]:
    """The keys of blocks first .. n_blocks - 1 of a sequence of tokens (each a full block of
    block_size tokens); before: the key of block first - 1 (empty for the first block)."""
    keys = []
    for i in range(first, n_blocks):
        block = array("q", tokens[i * block_size : (i + 1) * block_size])
        before = hashlib.sha256(before + block.tobytes()).digest()
        keys.append(before)
    return keys


class BlockPool:
    """Which blocks are free, how many owners each of the others has, and which are registered."""

    def __init__(self, n_blocks: int):
        self.n_blocks = n_blocks
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: the block freed last is reused first
        self._owners = [0] * n_blocks
        self._key_of: list[bytes | None] = [None] * n_blocks
        self._block_of: dict[bytes, int] = {}  # key -> its registered block
        self._cached: OrderedDict[int, None] = OrderedDict()  # registered blocks with no owner, oldest first

    @property
    def num_free(self) -> int:
        """Blocks that `allocate` can hand out: the free ones and the cached ones."""
        return len(self._free) + len(self._cached)

    def allocate(self, n: int) -> list[int] | None:
        """n blocks with one owner each, or None (and nothing taken) when fewer than n can be had.
        Free blocks first; then cached ones, the one let go longest ago first, their keys forgotten."""
        if n > self.num_free:
            return None
        taken = []
        for _ in range(n):
            if self._free:
                block = self._free.pop()  # from the top: O(n), not O(free)
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._key_of[block]]
                self._key_of[block] = None
            self._owners[block] = 1
            taken.append(block)
        return taken

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The registered blocks of the longest run of keys from the first (nothing is taken)."""
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def cached_among(self, blocks: Sequence[int]) -> int:
        """How many of blocks are cached (no owner): sharing them takes them from what `allocate` can have."""
        return sum(1 for block in blocks if self._owners[block] == 0)

    def share(self, blocks: Sequence[int]) -> None:
        """One more owner for each of blocks (a sequence that reuses them): in use, or cached."""
        if any(self._owners[block] == 0 and block not in self._cached for block in blocks):
            raise RuntimeError(f"blocks {list(blocks)} include a free one: nothing to share")
        for block in blocks:
            if self._owners[block] == 0:
                del self._cached[block]
            self._owners[block] += 1

    def register(self, block: int, key: bytes) -> None:
        """Name an owned block, whose tokens are all written, by its key. A key that names another
        block already (the same prefix prefilled twice at once) keeps that one."""
        if self._owners[block] == 0:
            raise RuntimeError(f"block {block} has no owner: only a written block can be registered")
        if self._key_of[block] is None and key not in self._block_of:
            self._key_of[block] = key
            self._block_of[key] = block

    def release(self, blocks: Sequence[int]) -> None:
        """One owner fewer for each of blocks; a block nobody owns is free again, or cached when
        registered. Checked whole before anything changes, so a bad call leaves the pool as it was."""
        counts: dict[int, int] = {}
        for block in blocks:
            counts[block] = counts.get(block, 0) + 1
        if any(self._owners[block] < n for block, n in counts.items()):
            raise RuntimeError(f"blocks {list(blocks)} include one released more often than it is owned")
        for block in blocks:
            self._owners[block] -= 1
        for block in dict.fromkeys(reversed(blocks)):  # the last block first: evicted first
            if self._owners[block] == 0:
                if self._key_of[block] is None:
                    self._free.append(block)
                else:
                    self._cached[block] = None

    def counts(self) -> tuple[int, int, int]:
        """(free, cached, in use): they add up to n_blocks."""
        in_use = sum(1 for owners in self._owners if owners > 0)
        return len(self._free), len(self._cached), in_use
