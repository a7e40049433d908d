"""`PrefixPort`: the Engine port's prefix-cache calls on an `MlxEngine`, which hands them here.

The prefix cache as the rest of a cluster sees it: its summary for the router (`prefix_summary`),
its blocks leaving for another node (`export_prefix`) and arriving from one (`import_prefix`:
validated and rebuilt in a worker thread), and blocks forgotten on demand (`evict_prefixes`). Each
call checks its arguments in trio and posts a command to the device thread, as the engine's other
calls do (`adapters.mlx.commands`). A tensor- or pipeline-parallel instance refuses the moves and
the eviction: its ranks hold shares of each cache and must keep the same blocks. This is an
adapter: nothing in `statecore` or `effects` may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import trio

from adapters.kv import frames
from adapters.mlx import commands
from adapters.mlx.device import DeviceLoop
from adapters.mlx.jobs import DeviceThread, Local
from adapters.mlx.kv_out import pieces_of
from adapters.mlx.payloads import validate_prefix
from adapters.mlx.performer import Performer
from adapters.mlx.settings import Settings
from effects.engine_port import KvBytes, KvPieces, ModelInfo, PrefixSummary, no_prefix_cache
from statecore.errors import Code, ErrorInfo, Fault, StatecoreError, client_error
from statecore.policy import token_ids
from statecore.prefix import conversation_block_bounds

__all__ = ["PrefixPort"]


class PrefixPort:
    """The prefix-cache calls of one engine (`running_info`: its model's info, raising once the
    device thread is gone; `parallel`: a tensor- or pipeline-parallel instance)."""

    def __init__(self, thread: DeviceThread, device: DeviceLoop, performer: Performer, settings: Settings,
                 running_info: Callable[[], ModelInfo], *, parallel: bool) -> None:
        self._thread = thread
        self._device = device
        self._performer = performer
        self._settings = settings
        self._running_info = running_info
        self._parallel = parallel

    async def export_prefix(self, tokens: Sequence[int]) -> KvPieces:
        checked = _checked_prefix(tokens, self._running_info())
        if self._parallel:
            raise _refuse_prefix_move("send")
        tensors: frames.HostTensors = await self._thread.post(commands.ExportPrefix(tuple(checked)))
        return pieces_of(tensors)

    async def import_prefix(self, payload: KvBytes, tokens: Sequence[int]) -> int:
        info = self._running_info()
        checked = _checked_prefix(tokens, info)
        if self._parallel:
            raise _refuse_prefix_move("receive")
        if self._device.prefix is None:
            return 0
        # Validated and rebuilt in a worker thread, as `install` does: the fingerprint (the chunk
        # size and block ends among it) is what makes the blocks the ones this node's own chunks
        # would compute.
        bounds = conversation_block_bounds(checked, self._settings.prefill_chunk_size,
                                           self._device.block_ends)
        count, caches = await trio.to_thread.run_sync(partial(
            validate_prefix, payload, len(checked), fingerprint=info.fingerprint,
            classes=self._performer.classes, bounds=frozenset(bounds)))
        kept: int = await self._thread.post(commands.Keep(tuple(checked[:count])), Local(caches=caches))
        return kept

    async def prefix_summary(self, since: int | None = None) -> PrefixSummary | None:
        prefix = self._device.prefix
        if prefix is None:
            return no_prefix_cache(since)
        if since is not None and since == prefix.index.version:  # an int read: no device job
            return None
        summary: PrefixSummary = await self._thread.post(commands.SummarizePrefixes())
        return summary

    async def evict_prefixes(self, nbytes: int) -> int:
        """Forget kept prefix-cache blocks until at least `nbytes` are freed or none is left, the
        way admission does when a request needs their memory (least recently used first, a block
        only after every block that extends it), between two steps; returns the bytes freed. A
        running request keeps the cache it made from them, so it goes on unchanged. For whoever
        wants that memory back now. Refused on a tensor-parallel instance: its ranks must keep
        the same blocks, and no lockstep command tells them to forget any."""
        if nbytes < 0:
            raise StatecoreError(client_error("nbytes must be >= 0"))
        if self._parallel:
            raise StatecoreError(ErrorInfo(
                Fault.UNSUPPORTED, Code.UNSUPPORTED_PARAMETER,
                "a tensor- or pipeline-parallel instance evicts prefix-cache blocks only for its "
                "requests: its ranks must forget the same blocks"))
        freed: int = await self._thread.post(commands.EvictPrefixes(nbytes))
        return freed


def _refuse_prefix_move(what: str) -> StatecoreError:
    return StatecoreError(ErrorInfo(
        Fault.UNSUPPORTED, Code.UNSUPPORTED_CACHE,
        f"a tensor- or pipeline-parallel instance does not {what} prefix-cache blocks: its ranks hold "
        "shares of each cache (the wire carries whole layers), so they would need a gather first"))


def _checked_prefix(tokens: Sequence[int], info: ModelInfo) -> list[int]:
    """A prefix's tokens (another node's blocks of a prompt) as `statecore.policy.token_ids` takes
    them; a refusal, or no token, raised as a client error."""
    checked = token_ids(tokens, info.vocab_size, "prefix token")
    if isinstance(checked, str) or not checked:
        raise StatecoreError(client_error(checked if isinstance(checked, str) else "the prefix is empty"))
    return checked
