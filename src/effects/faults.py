"""Fault injection for tests: make a chosen phase fail or stall for marked requests.

Off unless a node is started with `--inject-fault` *and* the environment variable
`STATECORE_ENABLE_FAULT_INJECTION=1`, so a production flag typo cannot turn it on. A request
is marked for a phase when its request id (the client's `X-Request-Id`, which travels
router -> prefill -> decode) contains `<marker>-<phase>` (fail there with a typed
INJECTED_FAULT error), `<marker>-untyped-<phase>` (raise a plain RuntimeError there, armed with
`PHASE:untyped`), `<marker>-peer-<phase>` (fail as a peer's error the router retries elsewhere,
on a request's first attempt only, armed with `PHASE:peer`) or `<marker>-slow-<phase>` (sleep
there first), e.g. `inject-fault-install-7`. A tag followed by `.choice<i>` marks only choice
i > 0 of an n > 1 request (the node's id `<request id>.<i>`), e.g. `inject-fault-prefill.choice1`. An injected
error says where it fired: "injected fault at prefill on the decode node".

The code that serves requests sees only the `FaultPort`, and asks it nothing unless it is `armed`
(a plain attribute): production runs `NO_FAULTS`, never armed, so serving never steps in here;
`Faults.parse` builds the armed one only behind the switch above. This module may import
`statecore` and trio; never httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import trio

from statecore.errors import Code, ErrorInfo, Fault, StatecoreError
from statecore.ids import RequestId

ENABLE_ENV = "STATECORE_ENABLE_FAULT_INJECTION"
DEFAULT_MARKER = "inject-fault"
CHOICE = ".choice"  # after a tag: one choice of an n > 1 request


class Phase(enum.Enum):
    INTAKE = "intake"
    TOKENIZE = "tokenize"
    PREFILL = "prefill"
    KV_ENCODE = "kv_encode"
    SEND_HEADER = "send_header"  # the KV body stops right after its first bytes
    MID_BODY = "mid_body"  # the KV body is cut in the middle
    CHECKSUM = "checksum"  # one KV byte is flipped
    INSTALL = "install"
    DECODE_STEP = "decode_step"  # the decoder fails after a few tokens
    STREAM_OUT = "stream_out"  # the decode node's stream to the router breaks
    DEVICE_CRASH = "device_crash"  # the engine's device thread dies (the node's transport)
    # The engine's decode model call raises an untyped RuntimeError inside a step that computes
    # the request: once (a transient device error: no request may fail), or every time (a
    # poisoned row: only that request may fail, the rows batched with it decode on).
    DECODE_CALL_ONCE = "decode_call_once"
    DECODE_CALL_ALWAYS = "decode_call_always"
    DECODE_CALL_HANG = "decode_call_hang"  # the decode model call never returns (a device hang)


ModelCallHook = Callable[[str, Sequence[str]], None]


class FaultPort(Protocol):
    """Where serving code may be made to fail on purpose (tests only). Callers check `armed`
    first and ask nothing when it is False; every method is cheap and does nothing for a request
    that is not marked."""

    @property
    def armed(self) -> bool:
        """Whether any check can fire (read on every request; `NO_FAULTS`' is a plain False)."""
        ...

    def applies(self, phase: Phase, request_id: str) -> bool:
        """A fail rule for `phase` matches this request."""
        ...

    async def at(self, phase: Phase, request_id: RequestId | str) -> None:
        """Stall and/or fail here when this request is marked for `phase`."""
        ...

    def model_call_hook(self) -> ModelCallHook | None:
        """A check for the engine to run inside each model call, or None."""
        ...


class NoFaults:
    """The production `FaultPort`: nothing is ever injected, so nothing is ever asked of it."""

    armed = False

    def applies(self, phase: Phase, request_id: str) -> bool:
        return False

    async def at(self, phase: Phase, request_id: RequestId | str) -> None:
        return None

    def model_call_hook(self) -> ModelCallHook | None:
        return None


NO_FAULTS: FaultPort = NoFaults()


@dataclass(frozen=True, slots=True)
class Rule:
    phase: Phase
    slow_s: float = 0.0  # 0: fail instead of stalling
    untyped: bool = False  # raise a plain RuntimeError (a bug's shape), not a typed error
    peer: bool = False  # a peer's error (the router retries it elsewhere), first attempts only

    @property
    def kind(self) -> str:
        return "slow" if self.slow_s > 0 else "untyped" if self.untyped else "peer" if self.peer else "fail"


@dataclass(frozen=True)
class Faults:
    """The armed `FaultPort`: rules by phase, matched on the marker in request ids."""

    rules: tuple[Rule, ...] = field(default_factory=tuple)
    marker: str = DEFAULT_MARKER
    where: str = ""  # the node's role, named in the errors it injects

    @classmethod
    def none(cls) -> FaultPort:
        return NO_FAULTS

    @classmethod
    def parse(cls, specs: Iterable[str], marker: str = DEFAULT_MARKER, where: str = "") -> FaultPort:
        """`PHASE` (fail), `PHASE:untyped` (fail with an untyped exception), `PHASE:peer` (fail as
        a peer, retryable) or `PHASE:slow=SECONDS`; refuses to arm without the env switch. No
        specs: `NO_FAULTS`. `where`: the node's role, for the errors' messages."""
        specs = list(specs)
        if not specs:
            return NO_FAULTS
        if os.environ.get(ENABLE_ENV) != "1":
            raise SystemExit(
                f"statecore: --inject-fault needs {ENABLE_ENV}=1 in the environment; "
                "fault injection is for tests only"
            )
        rules: list[Rule] = []
        for spec in specs:
            name, _, option = spec.partition(":")
            try:
                phase = Phase(name)
            except ValueError:
                raise SystemExit(
                    f"statecore: unknown fault phase {name!r}; one of {[p.value for p in Phase]}"
                ) from None
            slow = float(option.removeprefix("slow=")) if option.startswith("slow=") else 0.0
            rules.append(Rule(phase, slow, untyped=option == "untyped", peer=option == "peer"))
        return cls(tuple(rules), marker, where)

    @property
    def armed(self) -> bool:
        return bool(self.rules)

    def _rule(self, phase: Phase, request_id: str, kind: str) -> Rule | None:
        tag = f"{self.marker}-{phase.value}" if kind == "fail" else f"{self.marker}-{kind}-{phase.value}"
        at = request_id.find(tag)
        if at < 0:
            return None
        rest = request_id[at + len(tag):]
        if rest.startswith(CHOICE):  # one choice only: `<tag>.choice<i>` marks the node request `<id>.<i>`
            choice = rest[len(CHOICE):].partition("-")[0].partition(".")[0]
            if not request_id.endswith(f".{choice}"):
                return None
        if kind == "peer" and ".retry" in request_id:  # the router's next attempt goes through
            return None
        return next((r for r in self.rules if r.phase is phase and r.kind == kind), None)

    def applies(self, phase: Phase, request_id: str) -> bool:
        """A fail rule for `phase` matches this request."""
        return self._rule(phase, request_id, "fail") is not None

    async def at(self, phase: Phase, request_id: RequestId | str) -> None:
        """Stall, then fail, here when this request is marked for `phase` (`-slow-`: stall;
        `-untyped-`: raise a RuntimeError, as a bug would; else a typed INJECTED_FAULT)."""
        slow = self._rule(phase, request_id, "slow")
        if slow is not None:
            await trio.sleep(slow.slow_s)
        if self._rule(phase, request_id, "untyped") is not None:
            raise RuntimeError(f"injected untyped fault at {phase.value}{_on(where=self.where)}")
        if self._rule(phase, request_id, "peer") is not None:
            raise StatecoreError(replace(injected(phase, self.where), fault=Fault.PEER))
        if self.applies(phase, request_id):
            raise StatecoreError(injected(phase, self.where))

    def model_call_hook(self) -> ModelCallHook | None:
        """A check the engine runs inside each model call with its stage ("prefill" or "decode")
        and the request ids it computes, or None when no model-call fault is armed. Device
        thread only (it keeps which requests already failed once)."""
        once, always, hang = Phase.DECODE_CALL_ONCE, Phase.DECODE_CALL_ALWAYS, Phase.DECODE_CALL_HANG
        if not any(r.phase in (once, always, hang) for r in self.rules):
            return None
        fired: set[str] = set()

        def check(stage: str, request_ids: Sequence[str]) -> None:
            if stage != "decode":
                return
            for rid in request_ids:
                if self.applies(hang, rid):
                    threading.Event().wait()  # forever: only the watchdog gets the node out
                if self.applies(always, rid):
                    raise RuntimeError(f"injected fault at {always.value} ({rid})")
                if self.applies(once, rid) and rid not in fired:
                    fired.add(rid)
                    raise RuntimeError(f"injected fault at {once.value} ({rid})")

        return check


def _on(where: str) -> str:
    return f" on the {where} node" if where else ""


def injected(phase: Phase, where: str = "") -> ErrorInfo:
    """The error a typed fault raises: where it fired, the phase and the node's role."""
    return ErrorInfo(Fault.BUG, Code.INJECTED_FAULT, f"injected fault at {phase.value}{_on(where)}")


__all__ = [
    "CHOICE",
    "DEFAULT_MARKER",
    "ENABLE_ENV",
    "NO_FAULTS",
    "FaultPort",
    "Faults",
    "ModelCallHook",
    "NoFaults",
    "Phase",
    "Rule",
    "injected",
]
