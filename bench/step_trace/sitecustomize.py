"""Step-time tracing for benchmarks: with this folder on PYTHONPATH and STEP_TRACE set to a
directory, every Python process started so (nodes, engine core processes, clients) times a fixed
list of the engine's and the KV path's functions and writes one line per call to
STEP_TRACE/<pid>.log: `name start_s duration_ms thread` (start on the monotonic clock, shared by
the processes of one host). `bench/step_trace/timeline.py` reads them back. Python imports this
module by itself at start (`site`); without STEP_TRACE it does nothing. Bench code: nothing under
src/ imports it, and it imports nothing of the project until a traced module is imported.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, TextIO

# module -> (class or None for a module function, function name)
TRACED: dict[str, list[tuple[str | None, str]]] = {
    "adapters.mlx.executor": [("StepExecutor", "step"), ("StepExecutor", "read_back"),
                              ("StepExecutor", "settle")],
    "adapters.mlx.prefill_build": [("PrefillBuild", "build")],
    # a prompt's arrival on the device thread, its cached start, each of its calls (first turns:
    # bench/step_trace/first_turns.py)
    "adapters.mlx.performer": [("Performer", "register")],
    "adapters.mlx.prefix_cache": [("PrefixCache", "start")],
    "adapters.mlx.prefill": [(None, "run_units")],
    "adapters.frontend.prompts": [("Prompts", "encode_chat")],
    "adapters.kv.codec": [(None, "kv_piece_tensors")],
    "adapters.kv.shm_outbox": [("ShmOutbox", "put"), ("ShmOutbox", "reserve")],
    "adapters.mlx.payloads": [(None, "validate_segment"), (None, "validate_and_build")],
    "adapters.mlx.engine": [("MlxEngine", "prefill"), ("MlxEngine", "install"),
                            ("MlxEngine", "receive_segment"), ("MlxEngine", "install_segments"),
                            ("MlxEngine", "export_held")],
    "adapters.mlx.core_client": [("ProcessEngine", "receive_segment"), ("ProcessEngine", "install_segments")],
    "adapters.mlx.core_link": [("CoreLink", "_dispatch")],
    "adapters.mlx.core_kv": [("CoreKv", "share")],
    # a streamed first token's way out of the prefill core and into the decode node
    "adapters.mlx.kv_out": [(None, "tell_first_tokens"), (None, "hand_pieces"), ("PieceHandout", "__call__")],
    "adapters.mlx.core_wire": [("FrameWriter", "write")],
    "adapters.mlx.core_process": [("CoreServer", "_put"), ("CoreServer", "_incoming")],
    "adapters.mlx.managed_memory": [(None, "to_host"), (None, "to_device")],
    # pieces that stay in GPU memory: the sender's copy into its arena, the receiver's copy out
    "adapters.mlx.device_pieces": [("DeviceArena", "put"), (None, "take")],
    # the receiver's read kernel queued (its work goes with the next step), and the wait before an install
    "adapters.mlx.device_read": [(None, "read"), ("Reads", "settle")],
    "adapters.kv.frames": [(None, "end_frame")],
    "adapters.kv.stream": [(None, "document_record"), (None, "shared_segment_record"), (None, "read_record")],
    # a pulled payload checked and built on the decode node (its install's first part)
    "adapters.mlx.arriving": [("ArrivingKv", "receive"), ("ArrivingKv", "_keep"),
                              ("ArrivingKv", "built_payload")],
    # a streamed handoff's join on a decode node: its pieces staged, its install, its first steps
    "adapters.mlx.joining": [("Joining", "join"), ("Joining", "stage")],
    "adapters.mlx.staging": [("StagedSlots", "stage"), ("StagedSlots", "write_some"),
                             ("StagedSlots", "ready")],
    "adapters.mlx.keeping": [("PrefixKeeping", "keep_joined")],
    "adapters.mlx.slot_lane": [("SlotLane", "enter"), ("SlotLane", "build")],
    "adapters.mlx.slots": [("SlotPool", "reserve")],
    # the traced slot step's call: long where a new shape (rows, attended length) is traced
    "adapters.mlx.compiled": [("CompiledSlotStep", "__call__")],
    # speculative decoding: a verify step, its drafts, a prompt's last call with drafts
    "adapters.mlx.speculative": [("Speculator", "step"), ("Speculator", "propose"), ("Speculator", "verify"),
                                 ("Speculator", "hand_out_held")],
    "adapters.mlx.draft_model": [("DraftModel", "propose")],
    "adapters.mlx.first_verify": [("FirstVerify", "drafts")],
    "adapters.mlx.device": [("DeviceLoop", "hand_out")],
    "adapters.mlx.jobs": [("Inbox", "take")],
    "mlx.core": [(None, "async_eval"), (None, "eval")],
}

_lock = threading.Lock()
_out: TextIO | None = None


def _open(directory: str) -> TextIO:
    """This process's log, headed by its parent and command line (a core names its node so)."""
    global _out
    with _lock:
        if _out is None:
            os.makedirs(directory, exist_ok=True)
            _out = open(os.path.join(directory, f"{os.getpid()}.log"), "a", buffering=1)  # noqa: SIM115
            _out.write(f"# ppid {os.getppid()}\n# argv {' '.join(sys.argv)[:300]}\n")
        return _out


def _write(directory: str, name: str, start: float, seconds: float) -> None:
    out = _open(directory)
    with _lock:
        out.write(f"{name} {start:.6f} {seconds * 1000:.3f} {threading.current_thread().name}\n")


def _timed(directory: str, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                return await function(*args, **kwargs)
            finally:
                _write(directory, name, start, time.monotonic() - start)
        return timed_async

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            _write(directory, name, start, time.monotonic() - start)
    return timed


def _trace(directory: str, module: ModuleType, targets: Sequence[tuple[str | None, str]]) -> None:
    for owner, attribute in targets:
        holder: Any = module if owner is None else getattr(module, owner, None)
        if holder is None or not hasattr(holder, attribute):
            continue  # renamed since: the trace simply lacks it
        raw = inspect.getattr_static(holder, attribute)
        name = f"{owner or module.__name__.rsplit('.', 1)[-1]}.{attribute}"
        if isinstance(raw, staticmethod):
            setattr(holder, attribute, staticmethod(_timed(directory, name, raw.__func__)))
        else:
            setattr(holder, attribute, _timed(directory, name, raw))


class _TracingFinder(importlib.abc.MetaPathFinder):
    """Wraps the traced functions right after their module runs, before anyone imports them."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> ModuleSpec | None:
        if fullname not in TRACED:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module
        directory = self.directory

        def exec_module(module: ModuleType) -> None:
            run(module)
            _trace(directory, module, TRACED[fullname])

        loader.exec_module = exec_module
        return spec


def _extra(spec: str) -> None:
    """`STEP_TRACE_EXTRA`: more functions to time, `module:Class.function` or `module:function`,
    comma-separated (a one-off question's hops without editing the fixed list)."""
    for item in filter(None, (part.strip() for part in spec.split(","))):
        module, _, name = item.partition(":")
        owner, _, attribute = name.rpartition(".")
        TRACED.setdefault(module, []).append((owner or None, attribute))


if os.environ.get("STEP_TRACE"):
    _extra(os.environ.get("STEP_TRACE_EXTRA", ""))
    sys.meta_path.insert(0, _TracingFinder(os.environ["STEP_TRACE"]))
    if sys.argv and sys.argv[0]:  # a script or module run (its argv is set by now), not a bare interpreter
        _open(os.environ["STEP_TRACE"])
