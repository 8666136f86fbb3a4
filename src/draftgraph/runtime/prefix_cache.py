"""Automatic prefix caching: the KV of finished requests' full blocks, kept for later prompts
that start with the same tokens (vLLM's `--enable-prefix-caching`, SGLang's radix cache, in
blocks of `block_tokens` tokens).

A block is `block_tokens` consecutive positions of a sequence starting at a multiple of
`block_tokens`, keyed by (its parent block's id, its tokens): a key names the whole prefix up
to the block's end, exactly (the dict compares the tokens; no hash stands in for them). Its
pages (whole pages of the `PagedAllocator`) hold the KV of every model over the slot space
(target and drafters: one slot means the same position in every pool).

    match(tokens, limit)      the cached blocks that tokens[:limit] starts with; each is
                              referenced (never evicted) until the request gives it back
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
                              first, so a shared prefix outlives its branches)

NOTE: a cached block is only ever read. A request that borrows one writes KV at positions past
it (its first computed token is past every borrowed block); drafts, rejected tokens and a
launched step's slots all lie past a request's computed tokens.
"""

from __future__ import annotations

from collections import OrderedDict

# tokens a block holds (vLLM's default block size); a multiple of the page size is used
BLOCK_TOKENS = 16


class Block:
    __slots__ = ("key", "id", "pages", "refs")

    def __init__(self, key: tuple, block_id: int, pages: list[int]) -> None:
        self.key = key
        self.id = block_id
        self.pages = pages
        self.refs = 0


class PrefixCache:
    def __init__(self, allocator, stats: dict | None = None,
                 block_tokens: int = BLOCK_TOKENS) -> None:
        ps = allocator.page_size
        self.allocator = allocator
        self.block_tokens = -(-block_tokens // ps) * ps
        self.pages_per_block = self.block_tokens // ps
        self._blocks: dict[tuple, Block] = {}
        self._unused: OrderedDict[int, Block] = OrderedDict()  # refs == 0, oldest first
        self._next_id = 1  # 0: the root (no parent)
        # prompt tokens looked up and found (vLLM's prefix_cache_queries / _hits)
        self.stats = stats if stats is not None else {}
        self.stats.setdefault("prefix_cache_queries", 0)
        self.stats.setdefault("prefix_cache_hits", 0)
        allocator.cache = self

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._unused) * self.pages_per_block

    def _ref(self, block: Block) -> None:
        if block.refs == 0:
            self._unused.pop(block.id, None)
        block.refs += 1

    def match(self, tokens: list[int], limit: int) -> list[Block]:
        """The longest run of cached blocks that tokens[:limit] starts with, each referenced
        once more. Counts `limit` tokens queried and the run's tokens found."""
        b = self.block_tokens
        found: list[Block] = []
        parent = 0
        for i in range(limit // b):
            block = self._blocks.get((parent, tuple(tokens[i * b:(i + 1) * b])))
            if block is None:
                break
            found.append(block)
            parent = block.id
        for block in found:
            self._ref(block)
        self.stats["prefix_cache_queries"] += max(limit, 0)
        self.stats["prefix_cache_hits"] += len(found) * b
        return found

    def _cache(self, tokens: list[int], pages: list[int], chain: list[Block],
               spare: list[int] | None = None) -> bool:
        """A request's full blocks past `chain` (the blocks it references, appended to) as
        cached blocks it references: tokens[i * block_tokens:] is its block len(chain) + i,
        `pages` all its pages. At a block cached already (another request computed the
        same): with `spare`, that block is referenced instead and this copy's pages go to
        `spare`; without, it stops there and returns False."""
        b, ppb = self.block_tokens, self.pages_per_block
        parent = chain[-1].id if chain else 0
        for i in range(len(tokens) // b):
            j = len(chain)
            own = pages[j * ppb:(j + 1) * ppb]
            key = (parent, tuple(tokens[i * b:(i + 1) * b]))
            block = self._blocks.get(key)
            if block is None:
                block = self._blocks[key] = Block(key, self._next_id, own)
                self._next_id += 1
            elif spare is None:
                return False
            else:
                spare += own
            self._ref(block)
            chain.append(block)
            parent = block.id
        return True

    def share(self, tokens: list[int], pages: list[int], chain: list[Block]) -> bool:
        """A running request's newly computed full blocks become cached blocks now, so that
        requests arriving meanwhile find them (`_cache`'s arguments). Stops at a block cached
        already: returns False, and that copy stays the request's own until it ends
        (`release` then frees it)."""
        return self._cache(tokens, pages, chain)

    def release(self, tokens: list[int], pages: list[int], num_valid: int,
                borrowed: list[Block]) -> None:
        """A request gives back `pages` (its pages in position order, the blocks it
        references, `borrowed`, first): the full blocks of tokens[:num_valid] (their KV
        computed) stay cached, the borrowed blocks lose this request's reference, the other
        pages are freed. Clears `pages` and `borrowed`."""
        n, spare = len(borrowed) * self.block_tokens, []
        self._cache(tokens[n:min(num_valid, len(tokens)) // self.block_tokens
                           * self.block_tokens], pages, borrowed, spare)
        spare += pages[len(borrowed) * self.pages_per_block:]
        # the deepest block first in the queue: evicted before its parents
        for block in reversed(borrowed):
            block.refs -= 1
            if block.refs == 0:
                self._unused[block.id] = block
        self.allocator.free(spare)
        pages.clear()
        borrowed.clear()

    def evict(self, num_pages: int) -> int:
        """Free unreferenced blocks, least recently released first, until `num_pages` pages
        went back to the allocator (or none is left); returns the pages freed."""
        freed = 0
        while freed < num_pages and self._unused:
            _, block = self._unused.popitem(last=False)
            del self._blocks[block.key]
            freed += len(block.pages)
            self.allocator.free(block.pages)
        return freed

    def clear(self) -> int:
        """Free every unreferenced block (vLLM's reset_prefix_cache); returns the pages."""
        return self.evict(self.num_evictable_pages)
