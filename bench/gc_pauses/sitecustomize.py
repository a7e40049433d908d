"""Python's garbage collections, logged per process for benchmarks: with this folder on PYTHONPATH
and GC_LOG set to a directory, every Python process started so (nodes, routers, engine core
processes, clients, mlx_lm.server) writes GC_LOG/<pid>.gc: its command line, then one line per
collection of generation 1 or 2: `wall_clock gen<N> <wall>ms cpu=<thread CPU>ms gen2objs=<objects
a full pass walks> frozen=<gc.get_freeze_count()> collected=<N>`. Python imports this module by
itself at start (`site`); without GC_LOG it does nothing. `summary.py` reads the files back.
Bench code: nothing under src/ imports it; it imports only the standard library.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from typing import Any

_DIRECTORY = os.environ.get("GC_LOG")

if _DIRECTORY:
    _started: dict[int, tuple[float, float, int]] = {}
    _log = open(f"{_DIRECTORY}/{os.getpid()}.gc", "a", buffering=1)  # noqa: SIM115 (the process's life)
    _log.write("# " + " ".join(sys.argv)[:300] + "\n")

    def _logged(phase: str, info: dict[str, Any]) -> None:
        generation = info["generation"]
        if phase == "start":
            walked = len(gc.get_objects(2)) if generation == 2 else 0
            _started[generation] = (time.perf_counter(), time.thread_time(), walked)
        elif generation >= 1 and generation in _started:
            wall, cpu, walked = _started.pop(generation)
            _log.write(f"{time.time():.3f} gen{generation} {(time.perf_counter() - wall) * 1000:.1f}ms "
                       f"cpu={(time.thread_time() - cpu) * 1000:.1f}ms gen2objs={walked} "
                       f"frozen={gc.get_freeze_count()} collected={info['collected']}\n")

    gc.callbacks.append(_logged)
