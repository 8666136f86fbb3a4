"""Automatic prefix caching: the KV of finished requests' full blocks, kept for later prompts
that start with the same tokens (vLLM's `--enable-prefix-caching`, SGLang's radix cache, in
blocks of `block_tokens` tokens).

A block is `block_tokens` consecutive positions of a sequence starting at a multiple of
`block_tokens`, keyed by (its parent block's id, its tokens...): a key names the whole prefix
up to the block's end, exactly (the dict compares the tokens; no hash stands in for them). Its
pages (whole pages of the `PagedAllocator`) hold the KV of every model over the slot space
(target and drafters: one slot means the same position in every pool). A block is its id, an
int: requests hold lists of ids, `pages(blocks)` gives their pages.

    match(tokens, limit)      the cached blocks that tokens[:limit] starts with; each is
                              referenced (never evicted) until the request gives it back
    peek(tokens, limit)       how many there are (nothing referenced or counted)
    share(tokens, pages, chain)
                              a running request's newly computed full blocks cached at once
                              (requests arriving while it runs find them), referenced by it
    release(tokens, pages, num_valid, borrowed)
                              a request ends (or is preempted): the full blocks of its first
                              num_valid tokens become cached blocks (new ones, or one more
                              copy of a block already cached, whose pages are then freed),
                              the rest of its pages go back to the allocator
    evict(n)                  the allocator is short: unreferenced blocks freed, least
                              recently released first (a released chain's deepest block
                              first, so a shared prefix outlives its branches), their pages
                              given back in one call

NOTE: a cached block is only ever read. A request that borrows one writes KV at positions past
it (its first computed token is past every borrowed block); drafts, rejected tokens and a
launched step's slots all lie past a request's computed tokens.
"""

from __future__ import annotations

from collections import OrderedDict

# tokens a block holds (vLLM's default block size); a multiple of the page size is used
BLOCK_TOKENS = 16


class PrefixCache:
    def __init__(self, allocator, stats: dict | None = None,
                 block_tokens: int = BLOCK_TOKENS) -> None:
        ps = allocator.page_size
        self.allocator = allocator
        self.block_tokens = -(-block_tokens // ps) * ps
        self.pages_per_block = self.block_tokens // ps
        # NOTE: a block's state is ints and tuples of ints in these dicts: the cycle collector
        # untracks such a tuple at its first collection, so cached blocks add nothing to what
        # a full collection walks, or to what triggers one. A Block object and a page list per
        # block were two tracked objects each: 2,048 random prompts cost a full collection
        # of an engine-sized heap, 187 ms of collections in all against 44 ms now
        # (benchmarks/prefix_cache_host.py, 2-core Xeon)
        self._ids: dict[tuple, int] = {}  # key (parent id, *tokens) -> block id
        self._keys: dict[int, tuple] = {}  # block id -> key
        self._pages: dict[int, tuple[int, ...]] = {}  # block id -> its pages
        self._refs: dict[int, int] = {}  # block id -> requests referencing it
        self._unused: OrderedDict[int, None] = OrderedDict()  # refs == 0, oldest first
        self._next_id = 1  # 0: the root (no parent)
        # prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits)
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("prefix_cache_queries", 0)
        self.stats.setdefault("prefix_cache_hits", 0)
        allocator.cache = self

    @property
    def num_blocks(self) -> int:
        return len(self._ids)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._unused) * self.pages_per_block

    def pages(self, blocks: list[int]) -> list[int]:
        """The pages of `blocks` (ids), in order."""
        return [p for block in blocks for p in self._pages[block]]

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._unused[block]
        self._refs[block] += 1

    def _walk(self, tokens: list[int], limit: int) -> list[int]:
        b = self.block_tokens
        found: list[int] = []
        parent = 0
        for i in range(limit // b):
            block = self._ids.get((parent, *tokens[i * b:(i + 1) * b]))
            if block is None:
                break
            found.append(block)
            parent = block
        return found

    def peek(self, tokens: list[int], limit: int) -> int:
        """How many cached blocks tokens[:limit] starts with; nothing referenced or counted."""
        return len(self._walk(tokens, limit))

    def match(self, tokens: list[int], limit: int) -> list[int]:
        """The longest run of cached blocks that tokens[:limit] starts with, each referenced
        once more. Counts `limit` tokens queried and the run's tokens found."""
        found = self._walk(tokens, limit)
        for block in found:
            self._ref(block)
        self.stats["prefix_cache_queries"] += max(limit, 0)
        self.stats["prefix_cache_hits"] += len(found) * self.block_tokens
        return found

    def _cache(self, tokens: list[int], pages: list[int], chain: list[int],
               spare: list[int] | None = None) -> bool:
        """A request's full blocks past `chain` (the blocks it references, appended to) as
        cached blocks it references: tokens[i * block_tokens:] is its block len(chain) + i,
        `pages` all its pages. At a block cached already (another request computed the
        same): with `spare`, that block is referenced instead and this copy's pages go to
        `spare`; without, it stops there and returns False."""
        b, ppb = self.block_tokens, self.pages_per_block
        parent = chain[-1] if chain else 0
        for i in range(len(tokens) // b):
            j = len(chain)
            key = (parent, *tokens[i * b:(i + 1) * b])
            block = self._ids.setdefault(key, self._next_id)  # (the key hashed once)
            if block == self._next_id:  # a new block
                self._next_id += 1
                self._keys[block] = key
                self._pages[block] = tuple(pages[j * ppb:(j + 1) * ppb])
                self._refs[block] = 1
            elif spare is None:
                return False
            else:
                spare += pages[j * ppb:(j + 1) * ppb]
                self._ref(block)
            chain.append(block)
            parent = block
        return True

    def share(self, tokens: list[int], pages: list[int], chain: list[int]) -> bool:
        """A running request's newly computed full blocks become cached blocks now, so that
        requests arriving meanwhile find them (`_cache`'s arguments). Stops at a block cached
        already: returns False, and that copy stays the request's own until it ends
        (`release` then frees it)."""
        return self._cache(tokens, pages, chain)

    def release(self, tokens: list[int], pages: list[int], num_valid: int,
                borrowed: list[int]) -> None:
        """A request gives back `pages` (its pages in position order, the blocks it
        references, `borrowed`, first): the full blocks of tokens[:num_valid] (their KV
        computed) stay cached, the borrowed blocks lose this request's reference, the other
        pages are freed. Clears `pages` and `borrowed`."""
        n, spare = len(borrowed) * self.block_tokens, []
        self._cache(tokens[n:min(num_valid, len(tokens)) // self.block_tokens
                           * self.block_tokens], pages, borrowed, spare)
        spare += pages[len(borrowed) * self.pages_per_block:]
        # the deepest block first in the queue: evicted before its parents
        refs = self._refs
        for block in reversed(borrowed):
            refs[block] -= 1
            if refs[block] == 0:
                self._unused[block] = None
        self.allocator.free(spare)
        pages.clear()
        borrowed.clear()

    def evict(self, num_pages: int) -> int:
        """Free unreferenced blocks, least recently released first, until `num_pages` pages
        went back to the allocator (or none is left); returns the pages freed."""
        evicted: list[int] = []
        while len(evicted) * self.pages_per_block < num_pages and self._unused:
            block, _ = self._unused.popitem(last=False)
            del self._ids[self._keys.pop(block)], self._refs[block]
            evicted.append(block)
        # one call, in the order a call per block gave: the last evicted block's pages are
        # handed out first (a released chain, evicted deepest first, in ascending order)
        self.allocator.free([p for block in reversed(evicted) for p in self._pages.pop(block)])
        return len(evicted) * self.pages_per_block

    def clear(self) -> int:
        """Free every unreferenced block (vLLM's reset_prefix_cache); returns the pages."""
        return self.evict(self.num_evictable_pages)
