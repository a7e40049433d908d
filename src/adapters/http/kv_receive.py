"""How a decode node reads a prefill node's KV around httpx: a stream's records and a pulled payload.

A streamed handoff's records become the Peers port's items (`read_stream`: each piece checked by
the stream's own rules, its body received where the node's landing says, a piece in a prefill
node's shared memory read in place through its `adapters.kv.shm_inbox.ShmInbox`), and a pulled
payload comes straight into one buffer (`pull_direct`, over `adapters.kv.pull`). Their failures
are translated here, in one place, as `HttpxPeers` translates httpx's: a cut stream is
`kv_truncated`, a lost socket `transport_lost`, a slow one `timeout`, a peer's error answer its
typed error. `adapters.http.peers_httpx` calls these (where from, the prefill node's KV plane or
its shared memory, is its `KvSources`' to know); its httpx path (a test's injected transport)
reads a stream through `read_stream` too. This module imports trio; it must never import httpx
(the reads here go around it), mlx or mlx_lm.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import NoReturn

import h11
import pydantic
import trio

from adapters.http.internal_wire import PrefillReplyBody, error_from_json
from adapters.kv import pull as kv_pull
from adapters.kv import stream as kv_stream
from adapters.kv.blocking import run_blocking
from adapters.kv.shm_inbox import ShmInbox
from adapters.kv.shm_region import default_directory, parse_ref
from effects.ports import KvPieces, KvSegment, PrefillReply
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError

__all__ = ["pull_direct", "raise_error_document", "read_stream", "stream_errors", "with_deadline"]


@contextlib.contextmanager
def stream_errors(node: str) -> Iterator[None]:
    """A KV stream's failures as typed errors that come from the node (`ErrorInfo.origin`: so the
    router, hearing of one through the decode node, blames the right node), their words naming it."""
    try:
        yield
    except StatecoreError as exc:
        if exc.info.origin is not None:
            raise
        raise StatecoreError(replace(exc.info, message=f"{node}: {exc.info.message}", origin=node)) from exc
    except kv_pull.KvStreamCut as exc:
        raise StatecoreError(ErrorInfo(
            Fault.PEER, Code.KV_TRUNCATED, f"the KV stream from {node} was cut: {exc}", origin=node)) from exc
    except trio.TooSlowError as exc:
        raise StatecoreError(ErrorInfo(
            Fault.TRANSPORT, Code.TIMEOUT, f"{node} timed out streaming the KV", origin=node)) from exc
    except (OSError, trio.BrokenResourceError, h11.ProtocolError, kv_pull.KvPullError) as exc:
        raise StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST,
                                       f"lost the KV stream from {node}: {exc!r}", origin=node)) from exc


def raise_error_document(status: int, body: bytes, node: str | None = None) -> NoReturn:
    """A peer's error answer (a small JSON document) as its typed error, which comes from `node`
    where given (unless it names a node further away)."""
    try:
        data: object = json.loads(body)  # an error document: small
    except ValueError:
        data = None
    error = error_from_json(data, status)
    raise StatecoreError(error if node is None else error.came_from(node))


def with_deadline(read_into: kv_stream.ReadInto, seconds: float) -> kv_stream.ReadInto:
    """`read_into` that raises TooSlowError when one read takes longer than `seconds`."""
    async def read(view: memoryview) -> None:
        with trio.fail_after(seconds):
            await read_into(view)
    return read


async def read_stream(read_into: kv_stream.ReadInto, prompt_tokens: int, layers: int, inbox: ShmInbox | None,
                      landing: kv_pull.Landing, max_kv_bytes: int
                      ) -> AsyncGenerator[KvSegment | PrefillReply, None]:
    """A KV stream's records as the Peers port's items, each body received into `landing`; the
    stream's own checks on the way."""
    await kv_stream.read_preamble(read_into)
    coverage = kv_stream.SegmentCoverage(layers, prompt_tokens)
    taken: list[memoryview] = []

    def take(nbytes: int) -> memoryview:
        taken.append(landing.take(nbytes))
        return taken[-1]

    while True:
        try:
            record = await kv_stream.read_record(read_into, take, max_kv_bytes)
        except BaseException:
            for view in taken:  # a piece cut mid-body
                landing.give_back(view)
            raise
        finally:
            taken.clear()
        match record:
            case kv_stream.Segment(where=where, payload=payload):
                coverage.add(where)
                yield KvSegment(where.start, where.stop, where.first_layer, where.end_layer,
                                KvPieces((payload,)), record.last_step_started)
            case kv_stream.SharedSegment(where=where, reference=reference):
                if inbox is None:
                    raise StatecoreError(ErrorInfo(Fault.PEER, Code.KV_MALFORMED,
                                                   "a piece in shared memory nobody asked for"))
                coverage.add(where)
                ref = parse_ref(reference)
                view = await run_blocking(partial(inbox.read, ref), ref.nbytes)
                # the caller builds its arrays from the view before asking for the next piece;
                # an engine core process reads the region itself (where it looks for regions)
                here = inbox.directory == default_directory()
                yield KvSegment(where.start, where.stop, where.first_layer, where.end_layer,
                                KvPieces((view,), shared=ref if here else None), record.last_step_started)
                inbox.done(ref)  # raises when the region changed under the copy
            case kv_stream.Document(kind=kv_stream.FIRST_TOKEN, raw=raw):
                try:
                    reply = PrefillReplyBody.model_validate_json(raw)
                except pydantic.ValidationError as exc:
                    raise StatecoreError(ErrorInfo(
                        Fault.PEER, Code.KV_MALFORMED,
                        f"a malformed first token in the KV stream: {exc}")) from exc
                yield reply.reply()
            case kv_stream.Document(value=value):  # the prefill node's error
                raise StatecoreError(error_from_json(value, 502))
            case kv_stream.StreamEnd():
                coverage.finish(record)
                return


async def pull_direct(node: str, url: str, headers: Sequence[tuple[str, str]], *, max_kv_bytes: int,
                      connect_timeout_s: float, read_timeout_s: float, landing: kv_pull.Landing,
                      ssl_context: ssl.SSLContext, json_body: bytes | None = None) -> kv_pull.PulledKv:
    """A KV payload (GET, or POST of `json_body`) over `adapters.kv.pull`, straight into one
    buffer of `landing`, its failures typed as `stream_errors` types a stream's (coming from `node`)."""
    try:
        with trio.fail_after(read_timeout_s):
            pulled = await kv_pull.pull(url, headers, max_bytes=max_kv_bytes,
                                        connect_timeout_s=connect_timeout_s,
                                        buffers=landing, ssl_context=ssl_context,
                                        json_body=json_body)
    except kv_pull.KvTooLarge as exc:
        raise StatecoreError(ErrorInfo(
            Fault.PEER, Code.KV_TOO_LARGE, f"KV from {node} exceeds the limit: {exc}", origin=node)) from exc
    except trio.TooSlowError as exc:
        raise StatecoreError(ErrorInfo(
            Fault.TRANSPORT, Code.TIMEOUT, f"{node} timed out sending the KV", origin=node)) from exc
    except (OSError, trio.BrokenResourceError, h11.ProtocolError, kv_pull.KvPullError) as exc:
        raise StatecoreError(ErrorInfo(Fault.TRANSPORT, Code.TRANSPORT_LOST,
                                       f"lost the connection to {node}: {exc!r}", origin=node)) from exc
    if pulled.status >= 400:
        raise_error_document(pulled.status, bytes(pulled.body), node)
    return pulled
