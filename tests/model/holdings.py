"""What a request holds and what it was told, followed intent by intent: the model tests' second
oracle, beside the specs.

It is written from what each intent does on a node (the interpreter's meaning), never from the
tables' cleanup lists, so an edge that is wrong in both the table and its spec still fails here:
a timer left armed, a cache or a decoder row never released, a peer never told to stop, a request
that got no reply or two.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from statecore.events import Event, Finished, TimerFired
from statecore.intents import Complete, Intent, IntentKind, Reject, RespondTokens

TIMER, KV, REMOTE, ROW = "timer", "kv", "remote", "row"
# What a request may hold in each phase, by machine (any phase not named: nothing). A timer is
# the request's deadline or lease; `kv` a cache on this node; `remote` work or a cache on another
# node (the router's prefill and decode nodes; a decode node's prefill node); `row` a decoder row.
MAY_HOLD: dict[str, dict[str, frozenset[str]]] = {
    "request_router": {
        "routed": frozenset({TIMER, REMOTE}),
        "prefilling": frozenset({TIMER, REMOTE}),
        "handing_off": frozenset({TIMER, REMOTE}),
        "decoding": frozenset({TIMER, REMOTE}),
    },
    "request_prefill": {
        "prefill": frozenset({TIMER, KV}),
        "handoff": frozenset({TIMER, KV}),
    },
    "request_decode": {
        "prefilling_locally": frozenset({TIMER, KV}),
        "receiving_kv": frozenset({TIMER, REMOTE}),
        "installing": frozenset({TIMER, KV, REMOTE, ROW}),
        "decoding": frozenset({TIMER, ROW}),
    },
}


@dataclass
class Walk:
    """One request as a test follows it: the phase the spec gives it, its intents, what it holds."""

    phase: str
    intents: list[Intent] = field(default_factory=list)
    held: set[str] = field(default_factory=set)

    def take(self, machine: str, event: Event | None, intents: list[Intent]) -> None:
        """What `intents` (and the event that caused them) take and free on a `machine` node."""
        router = machine == "request_router"
        if isinstance(event, TimerFired):
            self.held.discard(TIMER)  # a fired timer is spent
        if isinstance(event, Finished):  # the engine (seen from the router: the peer) ended it
            self.held.discard(REMOTE if router else ROW)
        for intent in intents:
            self.intents.append(intent)
            match intent.kind:
                case IntentKind.ARM_DEADLINE | IntentKind.ARM_LEASE:
                    self.held.add(TIMER)
                case IntentKind.CANCEL_TIMER:
                    self.held.discard(TIMER)
                case IntentKind.START_PREFILL:
                    self.held.add(REMOTE if router else KV)
                case IntentKind.FETCH_KV:
                    self.held.add(REMOTE)
                case IntentKind.INSTALL_KV:
                    self.held.add(ROW)
                case IntentKind.RELEASE_KV:  # frees a cache here, or tells its owner it is taken
                    self.held -= {KV, REMOTE}
                case IntentKind.STOP_DECODING:
                    self.held.discard(ROW)
                case IntentKind.CANCEL_REMOTE:  # on a node it also cancels and frees what is local
                    self.held -= {REMOTE} if router else {REMOTE, KV, ROW}
                case _:
                    pass

    def over_held(self, machine: str, phase: str) -> set[str]:
        """What the request holds that `phase` may not hold."""
        return self.held - MAY_HOLD[machine].get(phase, frozenset())

    def reply_problem(self, machine: str, phase: str) -> str | None:
        """Why the replies of a request that settled in `phase` are wrong (None: they are right):
        `failed` gets one Reject, `done` one Complete (a prefill node's answer is its first token:
        one RespondTokens, no Complete), `cancelled` none; a reply is the last intent."""
        replies = Counter(type(i) for i in self.intents if isinstance(i, Complete | Reject | RespondTokens))
        got = (replies[Reject], replies[Complete])
        if phase == "failed":
            want = (1, 0)
        elif phase == "done":
            want = (0, 0) if machine == "request_prefill" else (0, 1)
            if machine == "request_prefill" and replies[RespondTokens] != 1:
                return f"{replies[RespondTokens]} first tokens"
        else:
            want = (0, 0)
        if got != want:
            return f"{got[0]} rejects and {got[1]} completes, wanted {want}"
        if sum(got) and not isinstance(self.intents[-1], Complete | Reject):
            return "the reply is not the last intent"
        return None
