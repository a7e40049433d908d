"""The prefix cache's two tiers against a model: hypothesis drives `statecore.prefix.PrefixIndex`.

A `RuleBasedStateMachine` keeps, beside one index with a device capacity and a host capacity
(0 sometimes: no host tier), its own mirror of where every block is, built only from the moves
the index reports (`Moved`), and its own least-recently-used order per tier. Rules do what the
engine does: keep a prompt's next blocks on the device as they are built (a host copy giving way
to the new one), look a prompt up and take its host blocks back (`promote`, what a request then
starts from), evict device bytes as admission does. After every rule: the mirror is the index
(nothing moved that was not reported; a block never in both tiers), each tier within its
capacity and its byte count the sum of its blocks', whole prefixes only (a device block's parent
on the device, a host block's held). Within the rules: every block leaving the device is the
least recently used one that no device block extends, every block the host pool forgets is its
least recently used leaf, a block leaves the device only when it is over capacity or asked to,
and the blocks a request starts from are on the device when it takes them (none taken away by
the promotion that brought them back). The run must have moved blocks to the host, back, and
out of it: it cannot pass by testing nothing. The cache that carries the arrays (blocks shared by
many prompts, looked up and kept as the device loop does, their bits and live bytes) has its own
model test, `test_prefix_cache_model.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from statecore.prefix import DEVICE, HOST, Moved, PrefixIndex, Tier, block_keys

CHUNK = 4
# Prompts as chains of blocks; the first two share their first two blocks (a shared system
# prompt), so blocks have several extensions.
_SHARED = [1] * 2 * CHUNK
PROMPTS = [block_keys(tokens, CHUNK) for tokens in (
    [*_SHARED, *[2] * 4 * CHUNK, 0],
    [*_SHARED, *[3] * 3 * CHUNK, 0],
    [*[4] * 5 * CHUNK, 0],
    [*[5] * 3 * CHUNK, 0],
)]


@dataclass
class Seen:
    """Over the whole run (every machine), so that the test checks it tested something."""

    to_host: int = 0
    back: int = 0
    forgotten_on_host: int = 0
    hits_after_back: int = 0


SEEN = Seen()


class TieredIndex(RuleBasedStateMachine):
    index: PrefixIndex

    @initialize(device=st.integers(60, 300), host=st.sampled_from([0, 40, 150, 400]))
    def start(self, device: int, host: int) -> None:
        self.index = PrefixIndex(device, host)
        self.tiers: dict[bytes, Tier] = {}
        self.sizes: dict[bytes, int] = {}
        self.parents: dict[bytes, bytes | None] = {}
        self.recent: dict[Tier, list[bytes]] = {DEVICE: [], HOST: []}  # least recently used first

    # -- the mirror ---------------------------------------------------------------------------

    def touch(self, tier: Tier, key: bytes) -> None:
        order = self.recent[tier]
        if key in order:
            order.remove(key)
        order.append(key)

    def place(self, key: bytes, tier: Tier) -> None:
        old = self.tiers.get(key)
        if old is not None:
            self.recent[old].remove(key)
        self.tiers[key] = tier
        self.touch(tier, key)

    def extended_on(self, key: bytes, tier: Tier) -> bool:
        return any(self.parents[k] == key and t == tier for k, t in self.tiers.items())

    def replay(self, moves: list[Moved], asked: int = 0, own: bytes | None = None,
               limit: int | None = None) -> None:
        """Apply the index's moves to the mirror, checking each is the one LRU says. `own`: the
        block just added, which may leave last, when nothing but its own prefix is left; `limit`:
        the device tier's bound in this operation (default its capacity)."""
        limit = self.index.capacity_bytes if limit is None else limit
        device_bytes = sum(self.sizes[k] for k, t in self.tiers.items() if t == DEVICE)
        freed = 0
        for at, moved in enumerate(moves):
            old = self.tiers.get(moved.key)
            assert old is not None, f"{moved} moves a block that is not held"
            if old == DEVICE and moved.to != DEVICE:
                eligible = [k for k in self.recent[DEVICE]
                            if not self.extended_on(k, DEVICE) and k not in self.protected]
                if eligible or moved.key != own:
                    assert eligible and moved.key == eligible[0], (moved, eligible)
                # only while over capacity or short of what was asked
                assert device_bytes - freed > limit or freed < asked, moved
                freed += self.sizes[moved.key]
            if old == HOST and moved.to is None:
                leaves = [k for k in self.recent[HOST] if not self.extended_on(k, HOST)]
                # the least recently used leaf, or an extension of a block forgotten next
                # (larger than the whole host pool: it goes, and what extends it with it)
                dropped = {m.key for m in moves[at + 1 :] if m.to is None and self.tiers.get(m.key) == DEVICE}
                assert leaves and (moved.key == leaves[0] or self.ancestors(moved.key) & dropped), moved
                SEEN.forgotten_on_host += 1
            if moved.to is None:
                self.recent[old].remove(moved.key)
                del self.tiers[moved.key]
            else:
                if moved.to == HOST:
                    SEEN.to_host += 1
                else:
                    SEEN.back += 1
                    device_bytes += self.sizes[moved.key]
                self.place(moved.key, moved.to)

    # -- the rules ----------------------------------------------------------------------------

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), depth=st.integers(1, 6), size=st.integers(10, 70),
          room=st.none() | st.integers(0, 150))
    def keep(self, prompt: int, depth: int, size: int, room: int | None) -> None:
        """A prompt's first `depth` blocks are built: each kept on the device if it is not, the
        device tier growing by `room` at most (what KV admission leaves; None: the capacity)."""
        keys = PROMPTS[prompt][:depth]
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else None
            if self.index.on_device(key):
                continue
            if parent is not None and not self.index.on_device(parent):
                break
            self.protected = self.ancestors(parent) | {key}
            device_before = sum(self.sizes[k] for k, t in self.tiers.items() if t == DEVICE)
            limit = self.index.capacity_bytes if room is None else min(self.index.capacity_bytes,
                                                                       device_before + room)
            moves = self.index.add(key, parent, size, room)
            assert device_before + size > limit or not moves, moves
            self.sizes[key], self.parents[key] = size, parent
            self.place(key, DEVICE)
            self.replay(moves, own=key, limit=limit)
            assert self.index.nbytes <= max(device_before, limit)

    @rule(prompt=st.integers(0, len(PROMPTS) - 1), room=st.none() | st.integers(0, 150))
    def request(self, prompt: int, room: int | None) -> None:
        """A request looks its prompt up and takes its host blocks back, the device tier growing by
        `room` at most (what KV admission leaves; None: the capacity alone); it starts from the
        device's blocks."""
        keys = PROMPTS[prompt]
        count = self.index.cached(keys)
        for key in keys[:count]:
            self.touch(DEVICE, key)
        on_host = self.index.on_host(keys, count)
        assert on_host == next((i for i, k in enumerate(keys[count:]) if self.tiers.get(k) != HOST),
                               len(keys) - count)
        if not on_host:
            return
        self.protected = self.ancestors(keys[count - 1]) if count else set()
        before = self.index.nbytes
        limit = self.index.capacity_bytes if room is None else min(self.index.capacity_bytes, before + room)
        moves = self.index.promote(keys, count, room)
        for moved in moves:
            if moved.to == DEVICE:
                self.protected.add(moved.key)  # what it brought back stays for the request
            self.replay([moved], limit=limit)
        assert self.index.nbytes <= max(before, limit)
        now = self.index.cached(keys)
        back = sum(1 for m in moves if m.to == DEVICE)
        assert now == count + back, (count, back, now)
        assert all(self.tiers.get(k) == DEVICE for k in keys[:now])
        if back:
            SEEN.hits_after_back += 1
        for key in keys[:now]:
            self.touch(DEVICE, key)

    @rule(nbytes=st.integers(0, 200))
    def evict(self, nbytes: int) -> None:
        """Admission needs `nbytes` of the device."""
        self.protected = set()
        self.replay(self.index.evict(nbytes), asked=nbytes)

    @rule(nbytes=st.integers(0, 200))
    def evict_host(self, nbytes: int) -> None:
        """The host needs `nbytes` of its memory back."""
        before = self.index.host_nbytes
        self.replay(self.index.evict_host(nbytes))
        assert before - self.index.host_nbytes >= min(nbytes, before)

    def ancestors(self, key: bytes | None) -> set[bytes]:
        found: set[bytes] = set()
        while key is not None:
            found.add(key)
            key = self.parents[key]
        return found

    # -- after every rule ---------------------------------------------------------------------

    @invariant()
    def the_mirror_is_the_index(self) -> None:
        device, host = self.index.device_keys(), self.index.host_keys()
        assert not set(device) & set(host), "a block in both tiers"
        assert device == self.recent[DEVICE] and host == self.recent[HOST]
        assert {k: DEVICE for k in device} | {k: HOST for k in host} == self.tiers
        assert self.index.nbytes == sum(self.sizes[k] for k in device) <= self.index.capacity_bytes
        assert self.index.host_nbytes == sum(self.sizes[k] for k in host) <= self.index.host_capacity_bytes

    @invariant()
    def whole_prefixes_only(self) -> None:
        for key, tier in self.tiers.items():
            parent = self.parents[key]
            if parent is None:
                continue
            assert parent in self.tiers, "a block held without its parent"
            if tier == DEVICE:
                assert self.tiers[parent] == DEVICE, "a device block whose parent left the device"


# derandomized: `test_the_run_moved_blocks_every_way` checks what this run covered, which a random run
# missed about 1 in 12 times
TieredIndex.TestCase.settings = settings(max_examples=60, stateful_step_count=40, derandomize=True)
test_tiered_prefix_index = TieredIndex.TestCase


def test_the_run_moved_blocks_every_way() -> None:
    """Runs after the machine (same module, file order): it moved blocks to the host, back, and
    out of the host pool."""
    assert SEEN.to_host and SEEN.back and SEEN.forgotten_on_host and SEEN.hits_after_back, SEEN
