"""The prefix cache's blocks and its host tier against a pure model, on real arrays: hypothesis
drives `adapters.mlx.prefix_cache.PrefixCache` as the device loop does.

`test_prefix_tiers_model.py` checks the index's policy (which key goes where, least recently
used first); this one checks the cache that carries the arrays, with nothing mocked: tiny real
KV (two layers, one key/value head or two, two dims; bf16, f16 or f32) in blocks of four tokens that also end
after an end-of-turn token, a device tier and a host tier of a few blocks each (the host tier
off sometimes), taken back always, never, or by the measured rule. The rules are the device
loop's: prompts arrive (many share a system prompt, or a document up to any token, so that they
match to within a block; some are an earlier prompt's or conversation's next turn, some go on
from a block in the host pool) and look their blocks up; a step computes a prompt's next blocks
into its own cache and keeps each, looking again first when another prompt has kept more of them
meanwhile; the kept arrays are evaluated with that step or a later one; a finished
conversation's blocks are kept (by a keep task that starts from the cached ones, or imported
from another node; some begin as a prompt in flight does); admission evicts device bytes and the
host gives bytes back; everything is released when the device tier is half full or more.
The model is plain data: where each block should be (read back from the cache only after
checking the move was allowed), what bits were stored under it (fresh random numbers at every
computation, so that a stale or wrong copy shows), what each prompt's cache holds.

Checked: a lookup returns a prefix of the prompt, exactly its leading blocks on the device
(after bringing host blocks back when the mode says so, as far as they fit beside their
prefix), with the bits stored under them, and counts a query, a hit and the tokens reused as it
should; a block is kept unless it cannot fit beside its own prefix, and nothing else moves when
it fits; what leaves the device goes to the host or is forgotten, nothing comes back but the
prompt's own blocks in a lookup; the device tier stays within its capacity and grows by no more
than the room KV admission leaves, the host pool within its own; no request's cache changes
under it (a request holds no block: it starts from a copy, and blocks are never written through
it), and the blocks a lookup or a keep builds on stay on the device while it does; the arrays
held are exactly what the index counts, whole prefixes only; MLX's own count of live bytes
says the device blocks hold their counted bytes and no more (a block that shares a prompt's
buffer keeps all of it alive), and that once everything is released nothing is left. The run
must have matched within a block, at a message's end and in a prompt of one chunk, looked
again, moved blocks out to the host, back and out of it, replaced a host copy, and released a
full cache: it cannot pass by testing nothing. Blocks end after every END but a prompt's last,
in prompts of any length, in most machines (`message_blocks` "all"), and after every END in
longer prompts only in others ("long"). Two to six seconds on the shared 2-core box.
"""

from __future__ import annotations

import gc
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from mlx_lm.models.cache import KVCache

from adapters.mlx.prefix_cache import PrefixCache
from statecore.prefix import ALL, DEVICE, HOST, LONG, MessageBlocks, Tier

CHUNK = 4
END = 0  # an end-of-turn token: a block also ends right after it
LAYERS, DIM = 2, 2
DTYPES = {"bfloat16": (mx.bfloat16, mx.uint16), "float16": (mx.float16, mx.uint16),
          "float32": (mx.float32, mx.uint32)}
MOST_REQUESTS = 4
UNBOUNDED = 1 << 40  # the room KV admission leaves when it leaves plenty

SYSTEM = (5, 6, 7, 8, 9, END)  # a system message: its end-of-turn token ends a block early
DOCUMENTS = (
    (*SYSTEM, 11, 12, 13, 14, 15, 16, 17, END, 18, 19, 20, 21, 22),
    (*SYSTEM, 11, 12, 13, 30, 31, 32, 33, 34, 35, 36),  # shares a block and part of the next
    (40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51),
)
# A prompt: a document up to any token, then a tail of its own (which may end a message too).
prompts = st.builds(lambda document, cut, tail: (*document[:cut], *tail),
                    st.sampled_from(DOCUMENTS), st.integers(3, 20),
                    st.lists(st.sampled_from((END, 1, 2, 3)), max_size=6))
SHORT_SYSTEM = (2, END)  # a system message shorter than a chunk
# A first turn of at most one chunk on it: a block shorter than a chunk, then a message of its
# own and a header.
first_turns = st.builds(lambda own: (*SHORT_SYSTEM, *own, END, 3),
                        st.lists(st.sampled_from((1, 2, 3)), max_size=1))
rooms = st.none() | st.integers(0, 400)

Name = tuple[tuple[int, ...], tuple[int, ...]]  # the model's block: the tokens up to its end, and every cut
Bits = list[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]  # per layer: keys' and values' bits


def model_cuts(tokens: tuple[int, ...], whole: bool, rule: MessageBlocks) -> list[int]:
    """Where the blocks end: every CHUNK tokens and after every END, within the prompt before its
    last token (but its last END; rule LONG: every END, and none when that is one chunk or
    less), or a whole conversation's tokens (every END)."""
    head = len(tokens) if whole else len(tokens) - 1
    ends = [position for position in range(1, head + 1) if tokens[position - 1] == END]
    if not whole and rule == ALL:
        ends = ends[:-1]
    elif not whole and head <= CHUNK:
        ends = []
    cuts: list[int] = []
    for position in range(1, head + 1):
        if position - (cuts[-1] if cuts else 0) == CHUNK or position in ends:
            cuts.append(position)
    return cuts


def names_of(tokens: tuple[int, ...], cuts: list[int]) -> list[Name]:
    return [(tokens[:end], tuple(cuts[: i + 1])) for i, end in enumerate(cuts)]


@dataclass
class Request:
    """A prompt on its way through prefill, as the model sees it."""

    tokens: tuple[int, ...]
    keys: list[bytes]
    names: list[Name]
    cuts: list[int]
    cache: list[Any]  # its own KVCache per layer
    expected: Bits  # what its cache holds up to `done_tokens`
    done_blocks: int = 0
    cached_tokens: int = 0
    pending: list[Any] = field(default_factory=list)  # kept arrays, evaluated with a later step

    @property
    def done_tokens(self) -> int:
        return self.cuts[self.done_blocks - 1] if self.done_blocks else 0


@dataclass
class Seen:
    """Over the whole run (every machine), so that the test checks it tested something."""

    hits: int = 0
    hits_within_a_block: int = 0  # a prompt that shares part of the block after its cached ones
    hits_at_a_message_end: int = 0  # ... whose cached blocks end at an end-of-turn token
    hits_in_one_chunk: int = 0  # ... inside a prompt of at most one chunk (a block shorter than it)
    looked_again: int = 0
    kept: int = 0
    refused_no_parent: int = 0
    to_host: int = 0
    back: int = 0
    forgotten_on_host: int = 0
    released_full: int = 0
    replaced_on_host: int = 0  # a block computed again while its copy was in the host pool
    collected: bool = False


SEEN = Seen()


def bits_of(array: Any, dtype: Any) -> np.ndarray[Any, Any]:
    return np.array(mx.contiguous(array).view(DTYPES[dtype][1]))


class CachedBlocks(RuleBasedStateMachine):
    cache: PrefixCache

    @initialize(dtype=st.sampled_from(sorted(DTYPES)), heads=st.sampled_from([1, 2]),
                device_blocks=st.integers(2, 6), host_blocks=st.sampled_from([1, 3, 8, 0]),
                pull=st.sampled_from([("always", None), ("auto", 1e3), ("never", None), ("auto", None)]),
                rule=st.sampled_from([ALL, ALL, LONG]))
    def start(self, dtype: str, heads: int, device_blocks: int, host_blocks: int,
              pull: tuple[str, float | None], rule: MessageBlocks) -> None:
        # MLX's buffer cache hands out a larger free buffer for a small array: off, so that the
        # bytes live are the arrays' own (restored at teardown)
        self.cache_limit = mx.set_cache_limit(0)
        # No collection while the machine runs, so that no other test's garbage is freed under
        # it (nothing here holds arrays in a cycle: they go when their last holder does); one
        # collection first, for the garbage there is (once: it takes tens of milliseconds).
        if not SEEN.collected:
            gc.collect()
            SEEN.collected = True
        gc.disable()
        self.live_before = mx.get_active_memory()
        self.dtype, self.heads, self.rule = dtype, heads, rule
        self.block = CHUNK * self.token_bytes
        self.room: int | None = None
        self.pull, seconds = pull
        self.pays = self.pull == "always" or seconds is not None  # auto: a prefill token takes 1,000 s
        self.cache = PrefixCache(CHUNK, device_blocks * self.block, host_blocks * self.block, self.pull,
                                 room=lambda: UNBOUNDED if self.room is None else self.room,
                                 prefill_token_s=lambda: seconds, ends=frozenset({END}), rule=rule)
        self.names: dict[bytes, Name] = {}
        self.stored: dict[Name, Bits] = {}
        self.tiers: dict[Name, Tier] = {}
        self.requests: list[Request] = []
        self.history: list[tuple[int, ...]] = []  # every prompt and conversation so far
        self.nonce = 0

    @property
    def token_bytes(self) -> int:
        return LAYERS * 2 * self.heads * DIM * DTYPES[self.dtype][0].size

    # -- the model's helpers -------------------------------------------------------------------

    def fresh(self, tokens: int) -> list[tuple[Any, Any]]:
        """Newly computed KV for `tokens` positions: numbers never seen before."""
        self.nonce += 1
        rng = np.random.default_rng(self.nonce)
        dtype = DTYPES[self.dtype][0]
        shape = (1, self.heads, tokens, DIM)
        return [tuple(mx.array(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)
                      for _ in range(2)) for _ in range(LAYERS)]  # type: ignore[misc]

    def name_keys(self, keys: list[bytes], names: list[Name]) -> None:
        """The cache's keys and the model's names are one to one."""
        assert len(keys) == len(names), (keys, names)
        for key, name in zip(keys, names, strict=True):
            assert self.names.setdefault(key, name) == name, "one key for two cuts of tokens"
        assert len(set(self.names.values())) == len(self.names), "two keys for one cut of tokens"

    def snapshot(self) -> dict[Name, Tier]:
        index = self.cache.index
        tiers = {self.names[key]: HOST for key in index.host_keys()}
        return tiers | {self.names[key]: DEVICE for key in index.device_keys()}

    def device_bytes(self, tiers: dict[Name, Tier]) -> int:
        return sum(self.size(name) for name, tier in tiers.items() if tier == DEVICE)

    def size(self, name: Name) -> int:
        return (name[1][-1] - (name[1][-2] if len(name[1]) > 1 else 0)) * self.token_bytes

    def parent(self, name: Name) -> Name | None:
        cuts = name[1][:-1]
        return (name[0][: cuts[-1]], cuts) if cuts else None

    def prefix_bytes(self, name: Name | None) -> int:
        held = 0
        while name is not None:
            held += self.size(name)
            name = self.parent(name)
        return held

    def limit(self, device_bytes: int) -> int:
        room = UNBOUNDED if self.room is None else self.room
        return min(self.cache.index.capacity_bytes, device_bytes + max(0, room))

    def moved(self, before: dict[Name, Tier], after: dict[Name, Tier], *, added: Name | None = None,
              back: Collection[Name] = (), out: bool = True) -> None:
        """Check the moves between two snapshots and take `after` as the model's: a block appears
        only when it is `added`, comes back to the device only for the prompt looked up (`back`:
        its blocks), leaves the device only when `out` allows; the host only forgets."""
        for name in before.keys() | after.keys():
            was, now = before.get(name), after.get(name)
            if was == now:
                continue
            if was is None:
                assert name == added, f"{name} appeared in {now}"
            elif was == DEVICE:
                assert out, f"{name} left the device"
                SEEN.to_host += now == HOST
            elif now == DEVICE:
                assert name in back or name == added, f"{name} came back to the device"
                SEEN.back += name != added
            else:
                SEEN.forgotten_on_host += 1
        self.tiers = after
        for name in list(self.stored):
            if name not in after:
                del self.stored[name]

    def expected_cache(self, names: list[Name]) -> Bits:
        return [tuple(np.concatenate([self.stored[name][layer][part] for name in names], axis=2)  # type: ignore[misc]
                      for part in (0, 1)) for layer in range(LAYERS)]

    # -- what the device loop does ---------------------------------------------------------------

    def lookup(self, request: Request, again: bool, counted: bool = True) -> None:
        """`start` (at arrival, or looking again; not `counted`: a conversation's keep task): the
        prompt's leading device blocks, host blocks brought back first when the mode says so and
        they fit beside their prefix."""
        cache = self.cache
        before = self.snapshot()
        device_before = self.device_bytes(before)
        queries, hits, reused, back = cache.queries, cache.hits, cache.tokens_reused, cache.host_back
        on_device = next((i for i, name in enumerate(request.names) if before.get(name) != DEVICE),
                         len(request.names))
        count, started = cache.start(request.keys, counted=counted, again=again, already=request.done_tokens,
                                     hit_before=request.cached_tokens > 0)
        after = self.snapshot()
        promoted = [n for n in request.names[on_device:count] if before.get(n) == HOST]
        assert promoted == request.names[on_device:count], "the lookup skipped a block"
        if not self.pays:
            assert count == on_device and after == before, "host blocks came back against the mode"
        # the prompt's own prefix stays on the device while blocks come back for it
        assert all(after.get(n) == DEVICE for n in request.names[:count]), "a block it starts from left"
        if self.pays and count < len(request.names) and before.get(request.names[count]) == HOST \
                and after.get(request.names[count]) == HOST:
            assert self.prefix_bytes(request.names[count]) > self.limit(device_before), "a block left behind"
        if not promoted:
            assert after == before, "blocks moved with nothing brought back"
        assert self.device_bytes(after) <= max(device_before, self.limit(device_before))
        self.moved(before, after, back=request.names, out=bool(promoted))
        assert cache.host_back - back == len(promoted)
        assert cache.queries - queries == (0 if again or not counted or not request.keys else 1)
        if count == 0:
            assert started is None
            assert cache.hits == hits and cache.tokens_reused == reused
            return
        assert started is not None and len(started) == LAYERS
        offset = request.cuts[count - 1]
        assert all(layer.offset == offset for layer in started), "not a prefix of whole blocks"
        assert cache.hits - hits == (0 if request.cached_tokens or not counted else 1)
        assert cache.tokens_reused - reused == (offset - request.done_tokens if counted else 0)
        if counted and not request.cached_tokens:
            SEEN.hits += 1
            SEEN.hits_at_a_message_end += request.tokens[offset - 1] == END
            SEEN.hits_in_one_chunk += len(request.tokens) - 1 <= CHUNK and offset < CHUNK
            # a held block after the same prefix starts as the prompt goes on: a match within it
            SEEN.hits_within_a_block += len(request.tokens) - 1 > offset and any(
                self.parent(name) == request.names[count - 1] and name[0][offset] == request.tokens[offset]
                for name in after)
        request.cached_tokens += offset - request.done_tokens
        request.cache = started
        request.done_blocks = count
        request.expected = self.expected_cache(request.names[:count])

    def keep(self, keys: list[bytes], names: list[Name], chunk: int, kv: list[Any], start: int, end: int,
             computed: list[tuple[Any, Any]]) -> list[Any]:
        """`keep` of a just computed block (`computed`: its arrays, now positions [start, end) of `kv`)."""
        name = names[chunk]
        before = self.snapshot()
        device_before = self.device_bytes(before)
        parent = names[chunk - 1] if chunk else None
        kept = self.cache.keep(keys, chunk, kv, start, end)
        after = self.snapshot()
        if before.get(name) == DEVICE or (parent is not None and before.get(parent) != DEVICE):
            SEEN.refused_no_parent += before.get(name) != DEVICE
            assert kept == [] and after == before, "a keep that had nothing to do moved blocks"
            return kept
        limit = self.limit(device_before)
        fits = device_before + self.size(name) <= limit
        stays = self.prefix_bytes(name) <= limit
        assert (after.get(name) == DEVICE) == stays, (name, device_before, limit)
        assert bool(kept) == stays
        if fits:
            assert after == {**before, name: DEVICE}, "blocks moved though the new one fit"
        # its prefix stays on the device while it is kept
        assert all(after.get(n) == DEVICE for n in names[:chunk]), "a block it builds on left the device"
        assert self.device_bytes(after) <= max(device_before, limit)
        self.moved(before, after, added=name, out=not fits)
        if name in after:
            SEEN.kept += 1
            SEEN.replaced_on_host += before.get(name) == HOST
            self.stored[name] = [(bits_of(k, self.dtype), bits_of(v, self.dtype)) for k, v in computed]
        return kept

    # -- the rules -----------------------------------------------------------------------------

    @precondition(lambda self: len(self.requests) < MOST_REQUESTS)
    @rule(tokens=prompts, turn=st.none() | st.integers(0, 15), room=rooms)
    def arrive(self, tokens: tuple[int, ...], turn: int | None, room: int | None) -> None:
        """A prompt arrives (a conversation's next `turn`: an earlier prompt or conversation
        followed by a new message): its leading blocks made the most recently used, then looked up."""
        self.room = room
        if turn is not None and self.history:
            tokens = (*self.history[turn % len(self.history)], *tokens)
        self.admit(tokens)

    @precondition(lambda self: len(self.requests) < MOST_REQUESTS)
    @rule(tokens=first_turns, room=rooms)
    def first_turn(self, tokens: tuple[int, ...], room: int | None) -> None:
        """A first turn shorter than a chunk on a short system message arrives (cut at the
        message's end when blocks end in such prompts too)."""
        self.room = room
        self.admit(tokens)

    @precondition(lambda self: len(self.requests) < MOST_REQUESTS and HOST in self.tiers.values())
    @rule(which=st.integers(0, 15), tokens=prompts, room=rooms)
    def come_back(self, which: int, tokens: tuple[int, ...], room: int | None) -> None:
        """A prompt goes on from a block in the host pool (a conversation taken up again later)."""
        self.room = room
        on_host = sorted(name for name, tier in self.tiers.items() if tier == HOST)
        self.admit((*on_host[which % len(on_host)][0], *tokens))

    def admit(self, tokens: tuple[int, ...]) -> None:
        self.history.append(tokens)
        keys = self.cache.keys_of(tokens)
        cuts = model_cuts(tokens, whole=False, rule=self.rule)
        request = Request(tokens, keys, names_of(tokens, cuts), cuts, [], [])
        self.name_keys(keys, request.names)
        self.cache.index.cached(keys)
        self.lookup(request, again=False)
        self.requests.append(request)

    @precondition(lambda self: bool(self.requests))
    @rule(which=st.integers(0, MOST_REQUESTS - 1), blocks=st.integers(1, 3), evaluate=st.booleans(),
          room=rooms)
    def compute(self, which: int, blocks: int, evaluate: bool, room: int | None) -> None:
        """A step computes a prompt's next `blocks` blocks into its own cache and keeps each (their
        arrays evaluated with this step, or a later one); past its blocks, it computes the rest
        and is done. About to start a block, it looks again when more of its blocks are on the
        device than it has (another prompt kept them meanwhile)."""
        self.room = room
        request = self.requests[which % len(self.requests)]
        kept: list[Any] = []
        for _ in range(blocks):
            if request.done_blocks < len(request.keys) and \
                    self.cache.index.cached(request.keys) > request.done_blocks:
                done = request.done_blocks
                self.lookup(request, again=True)
                assert request.done_blocks > done
                SEEN.looked_again += 1
            start, chunk = request.done_tokens, request.done_blocks
            end = request.cuts[chunk] if chunk < len(request.cuts) else len(request.tokens)
            computed = self.fresh(end - start)
            if not request.cache:
                request.cache = [KVCache() for _ in range(LAYERS)]  # type: ignore[no-untyped-call]
            for layer, (k, v) in zip(request.cache, computed, strict=True):
                layer.update_and_fetch(k, v)
            bits = [(bits_of(k, self.dtype), bits_of(v, self.dtype)) for k, v in computed]
            request.expected = bits if not request.expected else [
                (np.concatenate([old_k, k], axis=2), np.concatenate([old_v, v], axis=2))
                for (old_k, old_v), (k, v) in zip(request.expected, bits, strict=True)]
            if chunk == len(request.cuts):
                mx.eval(kept, request.pending)
                self.check_request(request, end)
                self.requests.remove(request)
                return
            request.done_blocks += 1
            kept.extend(self.keep(request.keys, request.names, chunk, request.cache, start, end, computed))
        if evaluate:
            mx.eval(kept, request.pending)
            request.pending = []
        else:
            request.pending.extend(kept)

    @rule(tokens=prompts, generated=st.lists(st.sampled_from((END, 1, 2)), max_size=6), task=st.booleans(),
          twin=st.none() | st.integers(0, MOST_REQUESTS - 1), room=rooms)
    def keep_conversation(self, tokens: tuple[int, ...], generated: list[int], task: bool, twin: int | None,
                          room: int | None) -> None:
        """A conversation's blocks kept in order: a finished request's keep `task` (which starts
        from the cached ones, not counted as a prompt) or another node's blocks, imported. A
        `twin` conversation began as a prompt in flight does (so that it finds more of its blocks
        kept when it looks again)."""
        self.room = room
        if twin is not None and self.requests:
            tokens = self.requests[twin % len(self.requests)].tokens
        whole = (*tokens, *generated)
        self.history.append(whole)
        keys = self.cache.conversation_keys_of(whole)
        cuts = model_cuts(whole, whole=True, rule=self.rule)
        names = names_of(whole, cuts)
        self.name_keys(keys, names)
        if task:
            self.lookup(Request(whole, keys, names, cuts, [], []), again=False, counted=False)
        computed = self.fresh(len(whole))
        imported: list[Any] = [KVCache() for _ in range(LAYERS)]  # type: ignore[no-untyped-call]
        for layer, (k, v) in zip(imported, computed, strict=True):
            layer.update_and_fetch(k, v)
        kept: list[Any] = []
        for chunk, (start, end) in enumerate(zip([0, *cuts], cuts, strict=False)):
            block = [(k[..., start:end, :], v[..., start:end, :]) for k, v in computed]
            kept.extend(self.keep(keys, names, chunk, imported, start, end, block))
        mx.eval(kept)

    @rule(device=st.integers(0, 4), host=st.integers(0, 4))
    def evict(self, device: int, host: int) -> None:
        """Admission needs `device` blocks' bytes of the device, then the host `host` blocks' of
        its memory back."""
        before = self.snapshot()
        self.cache.evict(device * self.block)
        after = self.snapshot()
        assert self.device_bytes(before) - self.device_bytes(after) >= min(device * self.block,
                                                                           self.device_bytes(before))
        self.moved(before, after)
        host_before = self.cache.host_nbytes
        self.cache.evict_host(host * self.block)
        assert host_before - self.cache.host_nbytes >= min(host * self.block, host_before)
        self.moved(after, self.snapshot(), out=False)

    @precondition(lambda self: 2 * self.cache.nbytes >= self.cache.index.capacity_bytes)
    @rule()
    def release_everything(self) -> None:
        """Every request done, every block evicted and forgotten: nothing is held."""
        cache = self.cache
        full = cache.nbytes > 0 and (cache.host_nbytes > 0 or not cache.index.host_capacity_bytes)
        mx.eval([request.pending for request in self.requests])
        self.requests.clear()
        # the device blocks are all that is left: they hold the bytes counted, no more (a block
        # that shared a request's buffer would keep all of it)
        assert mx.get_active_memory() - self.live_before == cache.nbytes, "blocks hold more than counted"
        cache.evict(cache.index.capacity_bytes)
        cache.evict_host(cache.index.host_capacity_bytes)
        assert (cache.nbytes, cache.host_nbytes, len(cache.index)) == (0, 0, 0)
        assert not cache._blocks and not cache._host
        self.moved(self.tiers, {})
        assert mx.get_active_memory() == self.live_before, "arrays outlived every block and request"
        SEEN.released_full += full

    def teardown(self) -> None:
        self.requests = []  # the next machine counts live arrays from nothing of this one's
        self.cache = self.cache.emptied()
        mx.set_cache_limit(self.cache_limit)
        gc.enable()

    # -- after every rule ------------------------------------------------------------------------

    def check_request(self, request: Request, tokens: int) -> None:
        for layer, (k, v) in zip(request.cache, request.expected, strict=True):
            assert layer.offset == tokens
            for held, want in ((layer.keys, k), (layer.values, v)):
                assert np.array_equal(bits_of(held[..., :tokens, :], self.dtype), want), "its cache changed"

    @invariant()
    def requests_keep_their_numbers(self) -> None:
        for request in self.requests:
            if request.cache:
                self.check_request(request, request.done_tokens)

    @invariant()
    def the_arrays_are_what_the_index_counts(self) -> None:
        cache, index = self.cache, self.cache.index
        device, host = set(index.device_keys()), set(index.host_keys())
        assert set(cache._blocks) == device and set(cache._host) == host and not device & host
        arrays = sum(int(k.nbytes) + int(v.nbytes) for block in cache._blocks.values() for k, v in block)
        assert index.nbytes == arrays <= index.capacity_bytes
        assert index.host_nbytes == sum(k[0].nbytes + v[0].nbytes for block in cache._host.values()
                                        for k, v in block) <= index.host_capacity_bytes
        assert self.snapshot() == self.tiers

    @invariant()
    def every_block_holds_its_bits(self) -> None:
        for key, block in self.cache._blocks.items():
            stored = self.stored[self.names[key]]
            for (k, v), (want_k, want_v) in zip(block, stored, strict=True):
                assert np.array_equal(bits_of(k, self.dtype), want_k)
                assert np.array_equal(bits_of(v, self.dtype), want_v)
        for key, copies in self.cache._host.items():
            stored = self.stored[self.names[key]]
            for ((k, k_type), (v, v_type)), (want_k, want_v) in zip(copies, stored, strict=True):
                assert k_type == v_type == DTYPES[self.dtype][0]
                assert np.array_equal(k.view(f"uint{8 * k.itemsize}"), want_k)
                assert np.array_equal(v.view(f"uint{8 * v.itemsize}"), want_v)

    @invariant()
    def whole_prefixes_only(self) -> None:
        for name, tier in self.tiers.items():
            parent = self.parent(name)
            if parent is not None:
                assert parent in self.tiers, "a block held without its parent"
                assert tier == HOST or self.tiers[parent] == DEVICE, "a device block whose parent left"


CachedBlocks.TestCase.settings = settings(max_examples=80, stateful_step_count=30)
test_prefix_cache_against_a_model = CachedBlocks.TestCase


def test_the_run_tested_blocks_every_way() -> None:
    """Runs after the machine (same module, file order)."""
    assert SEEN.hits and SEEN.hits_within_a_block and SEEN.hits_at_a_message_end, SEEN
    assert SEEN.hits_in_one_chunk, SEEN
    assert SEEN.looked_again and SEEN.kept and SEEN.refused_no_parent, SEEN
    assert SEEN.to_host and SEEN.back and SEEN.forgotten_on_host and SEEN.replaced_on_host, SEEN
    assert SEEN.released_full, SEEN
