"""The error taxonomy: whose fault it is, what HTTP status it hints, and a stable code.

Every failure a request can meet is one of these values. In the core they travel as data
inside `Failed` phases and `Reject` intents; only the shell raises them (as `StatecoreError`).
Kinds follow h11's local/remote split and trio's closed/broken split: the client's fault
(4xx), a peer's fault, our own bug, or a lost transport. Codes are stable, machine-readable
strings that clients may match on. A failure that crosses from one node to another also says
which node it comes from (`ErrorInfo.origin`), so that the node hearing of it last blames the
right one. This module must never import trio, httpx, mlx or mlx_lm.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace


class Fault(enum.Enum):
    """Whose fault a failure is."""

    CLIENT = "client"  # bad input: the caller can fix it
    UNSUPPORTED = "unsupported"  # well-formed, but this deployment cannot serve it
    OVERLOADED = "overloaded"  # try again later
    PEER = "peer"  # another node sent something wrong or failed
    TRANSPORT = "transport"  # the connection itself is gone
    CANCELLED = "cancelled"  # the client went away or asked to stop
    BUG = "bug"  # our own defect: an illegal transition, a broken invariant


class Code(enum.Enum):
    """Stable machine-readable error codes; the value is what clients see."""

    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    BODY_TOO_LARGE = "body_too_large"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"  # a body labelled other than JSON
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    KV_MEMORY_EXCEEDED = "kv_memory_exceeded"  # its KV cache can never fit the node's budget
    MODEL_NOT_FOUND = "model_not_found"
    UNSUPPORTED_CACHE = "unsupported_cache"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    OVERLOADED = "overloaded"
    DRAINING = "draining"
    NO_HEALTHY_PEER = "no_healthy_peer"
    KV_MALFORMED = "kv_malformed"
    KV_WRONG_MODEL = "kv_wrong_model"
    KV_TRUNCATED = "kv_truncated"
    KV_CHECKSUM = "kv_checksum_mismatch"
    KV_TOO_LARGE = "kv_too_large"
    KV_NOT_FOUND = "kv_not_found"
    KV_SHM_GONE = "kv_shm_gone"  # the shared memory a KV reference names was unlinked, reused or orphaned
    PREFIX_NOT_CACHED = "prefix_not_cached"  # the node's prefix cache holds none of those blocks
    LEASE_EXPIRED = "kv_lease_expired"
    PEER_FAILED = "peer_failed"
    ENGINE_FAILED = "engine_failed"
    TIMEOUT = "timeout"
    TRANSPORT_LOST = "transport_lost"
    CANCELLED = "cancelled"
    ILLEGAL_TRANSITION = "illegal_transition"
    INJECTED_FAULT = "injected_fault"
    UNAUTHORIZED = "unauthorized"
    INVALID_API_KEY = "invalid_api_key"  # the public API's key (OpenAI's code)
    INTERNAL = "internal_error"


_STATUS_BY_FAULT: dict[Fault, int] = {
    Fault.CLIENT: 400,
    Fault.UNSUPPORTED: 422,
    Fault.OVERLOADED: 503,
    Fault.PEER: 502,
    Fault.TRANSPORT: 503,
    Fault.CANCELLED: 499,
    Fault.BUG: 500,
}

# Codes whose status differs from their fault's default.
_STATUS_BY_CODE: dict[Code, int] = {
    Code.BODY_TOO_LARGE: 413,
    Code.UNSUPPORTED_MEDIA_TYPE: 415,
    Code.MODEL_NOT_FOUND: 404,
    Code.OVERLOADED: 429,
    Code.TIMEOUT: 504,
    Code.UNAUTHORIZED: 401,
    Code.INVALID_API_KEY: 401,
    Code.KV_NOT_FOUND: 404,
    Code.PREFIX_NOT_CACHED: 404,
    Code.LEASE_EXPIRED: 410,
}

# OpenAI's `error.type` vocabulary, by fault.
_OPENAI_TYPE_BY_FAULT: dict[Fault, str] = {
    Fault.CLIENT: "invalid_request_error",
    Fault.UNSUPPORTED: "invalid_request_error",
    Fault.OVERLOADED: "server_overloaded",
    Fault.PEER: "server_error",
    Fault.TRANSPORT: "server_error",
    Fault.CANCELLED: "cancelled",
    Fault.BUG: "server_error",
}


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """A failure as a value: whose fault, which code, what to tell a person."""

    fault: Fault
    code: Code
    message: str
    param: str | None = None  # the request field at fault, when one is (OpenAI's `param`)
    # The node it comes from, as the node holding this value names that node (its URL): set where
    # the error first reaches another node (`came_from`), or where a node finds a fault in what a
    # peer sent. None: not known, or made on this node and not yet sent anywhere.
    origin: str | None = None

    def came_from(self, node: str) -> ErrorInfo:
        """This error as it reaches this node from `node`: it comes from there, unless it already
        names the node it comes from (one further away, `node` only passing it on)."""
        return self if self.origin is not None else replace(self, origin=node)

    @property
    def http_status(self) -> int:
        return _STATUS_BY_CODE.get(self.code, _STATUS_BY_FAULT[self.fault])

    @property
    def openai_type(self) -> str:
        return _OPENAI_TYPE_BY_FAULT[self.fault]

    def to_openai(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {"message": self.message, "type": self.openai_type, "param": self.param,
                      "code": self.code.value}
        }


class StatecoreError(Exception):
    """The shell's exception carrying an `ErrorInfo`; the core never raises it."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(f"{info.code.value}: {info.message}")
        self.info = info


def client_error(message: str, code: Code = Code.INVALID_REQUEST, param: str | None = None) -> ErrorInfo:
    return ErrorInfo(Fault.CLIENT, code, message, param)


def peer_error(message: str, code: Code = Code.PEER_FAILED) -> ErrorInfo:
    return ErrorInfo(Fault.PEER, code, message)


def bug(message: str, code: Code = Code.INTERNAL) -> ErrorInfo:
    return ErrorInfo(Fault.BUG, code, message)


def unsupported_cache(class_names: list[str]) -> ErrorInfo:
    names = ", ".join(sorted(set(class_names))) or "<unknown>"
    return ErrorInfo(
        Fault.UNSUPPORTED,
        Code.UNSUPPORTED_CACHE,
        f"this model's cache cannot be handed off between nodes: cache class {names} "
        "has no wire codec",
    )


__all__ = [
    "Code",
    "ErrorInfo",
    "Fault",
    "StatecoreError",
    "bug",
    "client_error",
    "peer_error",
    "unsupported_cache",
]
