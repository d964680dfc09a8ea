"""Routing by prefix and load: which open upstream of a deployment takes a request.

vLLM keeps the KV cache of the prompts it has served (prefix caching, in blocks of tokens) and serves a prompt that
begins as an earlier one did from that cache — on the instance that served the earlier one; anywhere else it pays
the prefill again. The gateway does not tokenize: it reads the prompt as sent (a completion's prompt text or token
ids, a chat's messages) in blocks of ``BLOCK_BYTES`` and chains their hashes (the CRC-32 of the whole prefix so far,
at C speed, with the block's position), so two prompts that share their first k keys' blocks share those keys. A
key stands for the prompt up to the end of a block on a fixed scale (``KEY_ENDS``): every block of the first
``FINE_BLOCKS``, then ``KEYS_PER_OCTAVE`` keys each time the length doubles — a long prompt's shared prefix is
found to within a quarter of its length, and its keys cost a few calls, not one per block (an 8 KB prompt: 19 keys,
not 63).

Each upstream keeps an index of the keys routed to it, least recently used first and bounded by what its KV cache
holds (vLLM evicts that way too). Under the policy ``prefix`` a request goes:

1. to the upstream whose index holds the longest prefix of its keys, among those that may take it now (under their
   limit, not passed over after a refused connection, a KV cache not full by vLLM's own metrics) and under the load
   bound — consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): no upstream takes more
   than ``LOAD_FACTOR`` times its share of the requests in flight (plus this one), and ``LOAD_SLACK``;
2. a prompt no upstream has seen goes to its *home*, by rendezvous hashing of its first ``HOME_BLOCKS`` keys among
   those under the bound: adding or removing an upstream moves only the prefixes whose home it was or becomes;
3. a prompt shorter than a block, or every upstream over the bound: the fewest requests outstanding (the policy
   ``least_outstanding`` always routes so).

A hot prefix therefore spreads once its upstream holds its share, and from then on is found on both.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.gateway.admission import Upstream

RoutingPolicy = Literal["prefix", "least_outstanding"]
ROUTING_POLICIES: tuple[RoutingPolicy, ...] = ("prefix", "least_outstanding")
BLOCK_BYTES = 128  # about 32 tokens of text: two of vLLM's blocks of 16
MAX_BLOCKS = 2048  # a prompt's first 256 KiB choose where it goes (deeper, two upstreams are told apart anyway)
FINE_BLOCKS = 8  # a key at the end of each of the first 8 blocks (1 KiB)…
KEYS_PER_OCTAVE = 4  # …then 4 each time the length doubles (at 10, 12, 14, 16, 20, 24, … blocks)
HOME_BLOCKS = 4  # a new prompt's home is chosen by its first 512 bytes: prompts that share them go together
LOAD_FACTOR = 1.25  # no upstream takes more than this times its share of the requests in flight…
LOAD_SLACK = 2  # …plus this many: at light load one more request costs a batch next to nothing, a prefill much
BYTES_PER_TOKEN = 4  # a token of text is about four bytes of prompt (an index's bound from a KV cache's tokens)
DEFAULT_CACHE_TOKENS = 1 << 20  # an instance whose KV cache size is not known yet
KV_FULL = 0.95  # an upstream whose KV cache is this full (vLLM's metric) takes a prefix only if none else can
_MASK = (1 << 64) - 1


PREFIX_BYTES = BLOCK_BYTES * MAX_BLOCKS


def _key_ends() -> tuple[int, ...]:
    ends = list(range(1, FINE_BLOCKS + 1))
    step = FINE_BLOCKS // KEYS_PER_OCTAVE
    while ends[-1] < MAX_BLOCKS:
        for _ in range(KEYS_PER_OCTAVE):
            ends.append(min(MAX_BLOCKS, ends[-1] + step))
        step *= 2
    return tuple(dict.fromkeys(ends))


KEY_ENDS = _key_ends()  # key i stands for the prompt's first KEY_ENDS[i] blocks
# the blocks each key adds
KEY_SPANS = tuple(end - before for end, before in zip(KEY_ENDS, (0, *KEY_ENDS[:-1]), strict=True))
_ENDS_AT = [0] * (MAX_BLOCKS + 1)  # how many keys a prompt of n whole blocks has
for _i, _end in enumerate(KEY_ENDS):
    _ENDS_AT[_end] = _i + 1
for _n in range(1, MAX_BLOCKS + 1):
    _ENDS_AT[_n] = max(_ENDS_AT[_n], _ENDS_AT[_n - 1])


def keys_in(blocks: int) -> int:
    """How many keys a prompt of ``blocks`` whole blocks has."""
    return _ENDS_AT[min(blocks, MAX_BLOCKS)]


def blocks_of(keys: int) -> int:
    """How many blocks the first ``keys`` keys stand for."""
    return KEY_ENDS[keys - 1] if keys else 0


def prefix_keys(prompt: bytes | memoryview) -> list[int]:
    """The chained keys of ``prompt``'s whole blocks: key i stands for its first ``KEY_ENDS[i]`` blocks."""
    view = memoryview(prompt)
    crc = zlib.crc32
    keys: list[int] = []
    running = start = 0
    for end in KEY_ENDS[:keys_in(len(prompt) // BLOCK_BYTES)]:
        running = crc(view[start * BLOCK_BYTES:end * BLOCK_BYTES], running)
        keys.append(running | (end << 32))
        start = end
    return keys


def _mix(value: int) -> int:
    """SplitMix64's finaliser: a well-spread 64-bit weight for rendezvous hashing (the same in every process)."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK
    return value ^ (value >> 31)


class PrefixIndex:
    """The prefixes routed to one upstream, least recently used first, keys of at most ``capacity`` blocks."""

    __slots__ = ("capacity", "keys", "size")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.keys: OrderedDict[int, int] = OrderedDict()  # a key and the blocks it adds (KEY_SPANS)
        self.size = 0  # the blocks held

    @classmethod
    def for_tokens(cls, tokens: int | None) -> PrefixIndex:
        return cls(cls.blocks(tokens))

    @staticmethod
    def blocks(tokens: int | None) -> int:
        """How many blocks a KV cache of ``tokens`` holds."""
        return max(1, (tokens or DEFAULT_CACHE_TOKENS) * BYTES_PER_TOKEN // BLOCK_BYTES)

    def longest(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` it holds (a binary search: a prefix is added with all its keys)."""
        held = self.keys
        if not keys or keys[0] not in held:
            return 0
        if keys[-1] in held:
            return len(keys)
        lo, hi = 1, len(keys) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def add(self, keys: Sequence[int]) -> None:
        """A prompt of ``keys`` was sent here: its blocks are the most recently used, its first block most of all
        (as vLLM frees a request's blocks last to first, so that a prefix's tail is evicted before its head: what
        is held of a prompt is always its beginning)."""
        held = self.keys
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = span = KEY_SPANS[i]
                self.size += span
        self._evict()

    def _evict(self) -> None:
        held = self.keys
        while self.size > self.capacity and held:
            self.size -= held.popitem(last=False)[1]

    def resize(self, tokens: int | None) -> None:
        self.capacity = self.blocks(tokens)
        self._evict()


@dataclass
class RouteCounts:
    """How an upstream's requests were routed (since it opened)."""

    prefix: int = 0  # to the upstream that held the longest prefix of the prompt
    home: int = 0  # a prompt no upstream had seen, to its home
    load: int = 0  # by load alone: a short prompt, every upstream over the bound, or the least_outstanding policy
    matched_blocks: int = 0  # blocks of prompts found in its index (a guess at vLLM's prefix-cache hits)
    blocks: int = 0  # blocks of prompts routed to it

    @property
    def total(self) -> int:
        return self.prefix + self.home + self.load


@dataclass
class Routed:
    """What routing knows of one upstream: the prefixes sent to it, and how its requests were routed."""

    index: PrefixIndex = field(default_factory=lambda: PrefixIndex.for_tokens(None))
    counts: RouteCounts = field(default_factory=RouteCounts)


def instance_salt(instance: str) -> int:
    """An instance's seed in rendezvous hashing: the same in every process and after a restart of the engine."""
    return _mix(zlib.crc32(instance.encode()))


def _over(upstream: Upstream, bound: int) -> bool:
    return upstream.outstanding >= bound or (upstream.kv_usage is not None and upstream.kv_usage >= KV_FULL)


def pick(policy: RoutingPolicy, free: Sequence[Upstream], in_flight: int, opened: int,
         keys: Sequence[int] | None) -> Upstream:
    """The upstream of ``free`` (those that may take a request now; ``opened`` upstreams are open in all, with
    ``in_flight`` requests between them) that takes a request whose prompt has ``keys``; its index learns them."""
    if policy != "prefix" or not keys or len(free) < 2:
        chosen = min(free, key=_outstanding)
        chosen.routed.counts.load += 1
        if keys:
            chosen.routed.index.add(keys)
            chosen.routed.counts.blocks += blocks_of(len(keys))
        return chosen
    bound = math.ceil(LOAD_FACTOR * (in_flight + 1) / max(1, opened)) + LOAD_SLACK
    best: Upstream | None = None
    best_len = 0
    for upstream in free:
        if _over(upstream, bound):
            continue
        found = upstream.routed.index.longest(keys)
        if found > best_len or (found == best_len and found and best is not None
                                and upstream.outstanding < best.outstanding):
            best, best_len = upstream, found
    if best is not None:
        best.routed.counts.prefix += 1
        best.routed.counts.matched_blocks += blocks_of(best_len)
        chosen = best
    else:
        home_key = keys[min(HOME_BLOCKS, len(keys)) - 1]
        under = [u for u in free if not _over(u, bound)]
        if under:
            chosen = max(under, key=lambda u: _mix(home_key ^ u.salt))
            chosen.routed.counts.home += 1
        else:
            chosen = min(free, key=_outstanding)
            chosen.routed.counts.load += 1
    counts = chosen.routed.counts
    counts.blocks += blocks_of(len(keys))
    chosen.routed.index.add(keys)
    return chosen


def _outstanding(upstream: Upstream) -> int:
    return upstream.outstanding
