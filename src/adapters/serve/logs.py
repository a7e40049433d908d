"""How a node logs: one line per record (or one JSON object with `--log-json`), tagged with the
node's role since a local cluster's nodes share one stream, and one line per request transition.
This module may import anything.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from effects.runner import NodeRunner
from statecore.errors import ErrorInfo
from statecore.ids import RequestId

log = logging.getLogger("statecore")


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role  # several nodes may share one log stream (a local cluster does)

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"ts": record.created, "level": record.levelname, "role": self.role,
                               "logger": record.name, "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc)


def setup_logging(args: argparse.Namespace, role: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if args.log_json:
        handler.setFormatter(_JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role:7s} %(levelname)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per peer call is noise


def log_transitions(runner: NodeRunner[Any], role: str) -> None:
    def on_transition(rid: RequestId, old: str, new: str, event: str, error: ErrorInfo | None,
                      outcome: str | None) -> None:
        # a failure names its code and message; any other end its reason (stop, length, ...)
        failed = error is not None and outcome == error.code.value
        said = (f" reason={outcome}: {error.message}" if failed and error else
                f" reason={outcome}" if outcome else "")
        fields = {"request_id": rid, "role": role, "from": old, "to": new, "event": event,
                  "reason": outcome}
        log.info("request %s %s -> %s on %s%s", rid, old, new, event, said, extra={"fields": fields})

    runner.on_transition = on_transition
