"""One session's cache of one block, of any kind: page tables over the block's pool, written once.

A block's ``Pool`` is its share of the server's arena (``petals.kv_cache.arena``): the pages it took
for its sessions, laid out its kind's way. A session's ``KindCache`` of the block keeps a table of
those pages per sequence and how many tokens they hold. Growing (``reserve``), rewinding, releasing,
counting what is held and saying how far back it can go are the same for every kind, and live here.
A kind says only how it differs:

* its row layout: what a page holds (a ``Pool`` subclass: keys and values of so many tokens, one
  sequence's state and its snapshots, or nothing at all) and so how many pages a sequence of so many
  tokens needs (``Pool.pages_for``);
* what it gives back as it goes (``written``: the pages a sliding window no longer reaches);
* its rewind rule: how far back it can go (``resumable``, ``refusal``: a window's oldest kept token, a
  state's snapshots) and what it restores there (``restore``);
* how it moves beams (``reorder``) and which transformers ``Cache`` a forward sees (``merged``).

A kind's class registers itself for the spec types it ``serves`` (``MANAGERS``, as transformers' cache
layers do by their ``_layer_type``): adding a kind is its spec, its module and its tests.

Every page a cache takes or gives back is counted on its session's lease (``lease``:
``petals.kv_cache.lending``), which lends an idle session's pages, keeps an ended one's, and preempts,
for every kind alike. ``CacheGroup`` is a cache made of others used as one: a hybrid layer's
attention and state, a tensor-parallel block's shards.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from petals.kv_cache.arena import OutOfPagesError, PageArena
from petals.kv_cache.specs import CacheSpec

# the class that keeps one session's cache of each kind (exact spec type), filled as kinds are defined
MANAGERS: dict[type[CacheSpec], type] = {}


def _register(manager: type) -> None:
    """``manager`` keeps the caches of the spec types it names in its own ``serves``."""
    for spec_type in manager.__dict__.get("serves", ()):
        if MANAGERS.setdefault(spec_type, manager) is not manager:
            raise TypeError(f"{spec_type.__name__} is served by {MANAGERS[spec_type].__name__} already")


class CacheOverflowError(ValueError):
    """A step would write past the session's ``max_length``."""


class SessionPreempted(OutOfPagesError):
    """This session's pages went to another session (an older one that grew, or any session while this
    one was idle): its client replays it (``petals.kv_cache.lending``). Sent to the peer as ``preempted``."""

    kind = "preempted"


class Pool:
    """One block's pages of an arena, laid out its kind's way, shared by the block's sessions.

    On a server's ``arena`` a pool takes its pages from the free list every block shares, looking first
    at ``home`` (and, for a growing sequence, right after its last page); tests and measurements give a
    pool an arena of its own. ``page_tokens`` is how many tokens a page stands for. Pages are taken and
    given back under the arena's lock, counted on the taking session's lease.
    """

    unit = "pages"  # what a page holds, in errors ("pages of 16 tokens", "sequence states")

    def __init__(self, spec: CacheSpec, arena: PageArena | None, page_tokens: int, home: int = 0) -> None:
        self.spec, self.arena, self.home, self.page_tokens = spec, arena, home, page_tokens
        self.num_pages = arena.num_pages if arena is not None else 0
        self.lock = arena.lock if arena is not None else threading.RLock()
        self.on_free = arena.on_free if arena is not None else []
        self.pages_held = 0  # of the arena's pages, by this pool's sessions

    @classmethod
    def page_demand(
        cls, spec: CacheSpec, dtype: torch.dtype, page_tokens: int
    ) -> tuple[tuple[int, int], ...]:
        """``(bytes, row bytes)`` of each page the kind needs (what an arena's page size is made from)."""
        raise NotImplementedError

    @classmethod
    def for_budget(
        cls, spec: CacheSpec, tokens: int, page_tokens: int, dtype: torch.dtype, device: torch.device | str
    ) -> Pool:
        """A pool with an arena of its own for a budget of ``tokens`` tokens (measurements)."""
        raise NotImplementedError

    @classmethod
    def for_session(
        cls, spec: CacheSpec, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device | str
    ) -> Pool:
        """A pool holding one session's ``max_length`` tokens and no more (a standalone cache)."""
        raise NotImplementedError

    @property
    def parts(self) -> tuple[Pool, ...]:
        """The pools the server's budget counts for this one (a hybrid block's are two)."""
        return (self,)

    @property
    def free_pages(self) -> int:
        return self.arena.free_pages

    @property
    def page_nbytes(self) -> int:
        return self.arena.page_nbytes if self.arena is not None else 0

    @property
    def nbytes(self) -> int:
        """Bytes of the arena the pool's pages come from."""
        return self.arena.nbytes if self.arena is not None else 0

    def pages_for(self, tokens: int) -> int:
        """Pages one sequence of ``tokens`` tokens holds (at most: a window may give some back)."""
        return -(-tokens // self.page_tokens)

    def max_pages(self, length: int) -> int:
        """The most pages one sequence of ``length`` tokens ever holds: a kind that keeps only its last
        tokens (a sliding window) holds them from any offset in a page, so one page more than they fill."""
        held = self.spec.tokens_held(length)
        return self.pages_for(held) + (held < length)

    def make_room(self, count: int, lease: Any = None) -> None:
        """Have ``count`` pages free for ``lease``'s session (``PageArena.make_room``)."""
        self.arena.make_room(count, lease, self.unit)

    def take(self, count: int, after: int | None = None, lease: Any = None) -> list[int]:
        """``count`` pages, the ones after page ``after`` if they are free (a sequence's pages then lie
        one after another), else the first free ones from the pool's home on."""
        near = self.home if after is None else after + 1
        with self.lock:
            pages = self.arena.take(count, near, self.unit, lease)
            self.pages_held += count
            if lease is not None:
                lease.took(self.arena, count)
        return pages

    def give_back(self, pages: Sequence[int], lease: Any = None) -> None:
        if not pages:
            return
        with self.lock:
            self.pages_held -= len(pages)
            if lease is not None:
                lease.gave(self.arena, len(pages))
        self.arena.give_back(pages)


class KindCache:
    """One session's cache of one block: a table of pages per sequence over the block's ``Pool``, and how
    many tokens they hold. Without a pool it is standalone and takes its whole ``max_length`` up front
    (tests, measurements); a server opens its sessions' caches on the block's pool (``paged``), on the
    session's ``lease``. Subclasses are the kinds (see the module docstring)."""

    pool_class: ClassVar[type[Pool]]
    serves: ClassVar[tuple[type[CacheSpec], ...]] = ()  # the spec types this kind's class keeps

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    def __init__(
        self,
        spec: CacheSpec,
        batch_size: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        pool: Pool | None = None,
        layer_index: int = 0,
        lease: Any = None,
    ) -> None:
        standalone = pool is None
        if pool is None:
            pool = self.pool_class.for_session(spec, batch_size, max(max_length, 1), dtype, device)
        self.pool, self.spec, self.layer_index, self.lease = pool, spec, layer_index, lease
        self.num_sequences, self.max_length = batch_size, max_length
        self.length = 0
        self.dropped = 0  # pages at the start of every row given back (a sliding window's)
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self._released = False
        self._changed()
        self.reserve(
            max_length if standalone else 0
        )  # a kind whose sequences need a page from the start takes it

    @classmethod
    def paged(
        cls, pool: Pool, batch_size: int, max_length: int, layer_index: int = 0, lease: Any = None
    ) -> KindCache:
        """A session's cache on a block's shared pool: it takes pages as it grows, counted on ``lease``."""
        return cls(pool.spec, batch_size, max_length, pool=pool, layer_index=layer_index, lease=lease)

    @classmethod
    def make_pool(
        cls,
        spec: CacheSpec,
        tokens: int,
        page_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        arena: PageArena | None = None,
        home: int = 0,
    ) -> Pool:
        """A block's pool, shared by its sessions: on a server's ``arena`` (its pages looked for from ``home``
        on), or with an arena of its own for a budget of ``tokens`` tokens in pages of ``page_tokens``."""
        if arena is not None:
            return cls.pool_class(spec, dtype=dtype, arena=arena, home=home)
        return cls.pool_class.for_budget(spec, tokens, page_tokens, dtype, device)

    @classmethod
    def page_demand(
        cls, spec: CacheSpec, dtype: torch.dtype, page_tokens: int
    ) -> tuple[tuple[int, int], ...]:
        """``(bytes, row bytes)`` of each page this kind needs (what an arena's page size is made from)."""
        return cls.pool_class.page_demand(spec, dtype, page_tokens)

    @classmethod
    def merged(cls, caches: Sequence[KindCache]):
        """One transformers ``Cache`` over all rows of ``caches`` (sessions on the same block), for one forward."""
        raise NotImplementedError

    def view(self):
        """This session alone, as a transformers ``Cache``."""
        return self.merged([self])

    @property
    def position(self) -> int:
        """How many tokens are cached."""
        return self.length

    @property
    def pages_held(self) -> int:
        return sum(len(table) for table in self.tables)

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this cache holds."""
        return self.pages_held * self.pool.page_nbytes

    @property
    def first_held(self) -> int:
        """The first position whose tokens are still held."""
        return self.dropped * self.pool.page_tokens

    # ---- growing ---------------------------------------------------------------------------------

    def reserve(self, new_tokens: int) -> None:
        """Take the pages that ``new_tokens`` more tokens need (raises, taking none, if it cannot)."""
        end = self.length + new_tokens
        if end > self.max_length:
            raise CacheOverflowError(
                f"Maximum length exceeded: {self.length} cached + {new_tokens} new tokens "
                f"> max_length {self.max_length}"
            )
        missing = self.pool.pages_for(end) - self.dropped - len(self.tables[0]) if self.tables else 0
        if missing <= 0:
            return
        with self.pool.lock:
            self._check_open()
            self.pool.make_room(missing * self.num_sequences, self.lease)  # may preempt: then raises
            self._check_open()
            taken = []
            for table in self.tables:  # each row after its last page: a lone sequence's pages stay in a row
                table.extend(self.pool.take(missing, table[-1] if table else None, self.lease))
                taken.extend(table[-missing:])
        self._changed()
        self._initialize(taken)

    def _check_open(self) -> None:
        if self._released:
            if self.lease is not None and self.lease.preempted:
                raise SessionPreempted(self.lease.preemption)
            raise RuntimeError("this session's cache was released: the session has ended")

    def _initialize(self, pages: list[int]) -> None:
        """Called with the pages just taken (a state starts from zeros; keys need nothing: only written
        slots are read)."""

    def advance(self, new_tokens: int) -> None:
        """A step of ``new_tokens`` tokens is written and read: move on, and give back what the kind no
        longer needs."""
        self.length += new_tokens
        self.written()

    def written(self) -> None:
        """Called after a step's tokens are written and read (a window gives back what it no longer needs)."""

    # ---- rewinding ---------------------------------------------------------------------------------

    def resumable(self, position: int) -> int:
        """The furthest position up to ``position`` this cache can rewind to now (0 at worst)."""
        return min(position, self.length)

    def refusal(self, position: int) -> str:
        """Why this cache cannot rewind to ``position`` (where ``resumable`` says it cannot)."""
        return f"cannot rewind to position {position}"

    def restore(self, position: int) -> None:
        """Make the cache what it was at ``position`` (which ``resumable`` allows), beyond dropping pages."""

    def rewind(self, position: int) -> None:
        """Forget every token from ``position`` on (the next step writes there); give back unused pages."""
        if not 0 <= position <= self.length:
            raise ValueError(f"cannot rewind to position {position}: {self.length} tokens are cached")
        if position == self.length:
            return
        if self.resumable(position) != position:
            raise ValueError(self.refusal(position))
        self.restore(position)
        self.length = position
        if position == 0:  # a fresh start needs nothing that was dropped
            self._give_back(self.pool.pages_for(0))
            self.dropped = 0
        else:
            self._give_back(self.pool.pages_for(position) - self.dropped)

    def _give_back(self, keep: int, *, front: int = 0) -> None:
        """Give back each row's pages past its first ``keep`` (or, with ``front``, its first ``front``)."""
        freed = []
        for table in self.tables:
            if front:
                freed.extend(table[:front])
                del table[:front]
            else:
                freed.extend(table[keep:])
                del table[keep:]
        if freed:
            self.pool.give_back(freed, self.lease)
            self._changed()

    # ---- beams, ending -----------------------------------------------------------------------------

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        """Reorder the batch (beam search): row ``i`` becomes old row ``hypo_ids[i]``."""
        raise NotImplementedError

    def release(self) -> None:
        """Give every page back to the pool; the cache takes no more (the session has ended)."""
        with self.pool.lock:
            if self._released:
                return
            self._released = True
            self.release_pages()

    def release_pages(self) -> None:
        """Give every page back and start over at position 0."""
        with self.pool.lock:
            pages = [page for table in self.tables for page in table]
            for table in self.tables:
                table.clear()
            self.pool.give_back(pages, self.lease)
        self.length = self.dropped = 0
        self._changed()

    def _changed(self) -> None:
        """Called whenever the page tables change (a kind drops what it derived from them)."""


class CacheGroup:
    """A session's cache of one block made of several caches used as one (``parts``, of one session):
    grown, rewound, reordered and released together, as far back as every part can go."""

    serves: ClassVar[tuple[type[CacheSpec], ...]] = ()  # as ``KindCache.serves``

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _register(cls)

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = tuple(parts)

    @property
    def position(self) -> int:
        return self.parts[0].position

    @property
    def length(self) -> int:
        return self.parts[0].length

    @property
    def num_sequences(self) -> int:
        return self.parts[0].num_sequences

    @property
    def max_length(self) -> int:
        return self.parts[0].max_length

    @max_length.setter
    def max_length(self, value: int) -> None:
        for part in self.parts:
            part.max_length = value

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def reserve(self, new_tokens: int) -> None:
        for part in self.parts:
            part.reserve(new_tokens)

    def advance(self, new_tokens: int) -> None:
        for part in self.parts:
            part.advance(new_tokens)

    def resumable(self, position: int) -> int:
        return furthest_common(self.parts, position)

    def rewind(self, position: int) -> None:
        """Rewind every part, once every part is known to go there: none is changed if one refuses."""
        for part in self.parts:
            if position <= part.position and part.resumable(position) != position:
                raise ValueError(part.refusal(position))
        for part in self.parts:
            part.rewind(position)

    def reorder(self, hypo_ids: torch.Tensor) -> None:
        for part in self.parts:
            part.reorder(hypo_ids)

    def release(self) -> None:
        for part in self.parts:
            part.release()


class ShardCaches(CacheGroup):
    """A tensor-parallel block's cache in one session: one cache per shard (each keeps its heads), whose
    forward takes the shards' views side by side (``petals.convert.TensorParallelBlock``)."""

    @staticmethod
    def merged(caches: Sequence[ShardCaches]) -> list:
        """Several sessions' caches of this block, shard by shard, for one forward."""
        shards = range(len(caches[0].parts))
        return [
            type(caches[0].parts[rank]).merged([cache.parts[rank] for cache in caches]) for rank in shards
        ]

    def view(self) -> list:
        return self.merged([self])


def furthest_common(caches: Sequence[Any], position: int) -> int:
    """The furthest position up to ``position`` that every one of ``caches`` can rewind to."""
    while True:
        point = min((cache.resumable(position) for cache in caches), default=position)
        if point == position:
            return point
        position = point
