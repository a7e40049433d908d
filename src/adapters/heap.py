"""A serving process's heap and Python's cyclic garbage collector.

A full (generation 2) collection walks every container object the process holds, with the GIL
held: in a node or router that is the objects its imports, model and tokenizer left (~122,000
and 71-75 ms of CPU a pass on the 2-core CPU box; ~466,000 and 180 ms in a GPU node), whenever
enough long-lived objects have piled up (once in two minutes of a handoff run, in a router). Each
pass stalls every stream that process carries: its front end's deliveries and, in-process, its
device thread's steps. What startup built lives as long as the process, so once a process is
about to serve, `freeze_startup_heap` collects what startup left unreachable and moves the rest
into the collector's permanent generation (`gc.freeze`), which no pass walks: full collections
then cost what serving itself keeps. Plain stdlib: this module must never import mlx, trio or
anything of the project (the router, which loads no engine, calls it too).
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect startup's garbage, then freeze every object alive now out of the collector's
    passes; the number frozen (`gc.get_freeze_count`). Call it once, when startup is done."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


__all__ = ["freeze_startup_heap"]
