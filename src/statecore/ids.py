"""Typed identifiers shared by every machine.

NewType wrappers so a request id is never passed where a peer id is expected. This module
must never import trio, httpx, mlx or mlx_lm: it is part of the pure core.
"""

from __future__ import annotations

from typing import NewType

RequestId = NewType("RequestId", str)
PeerId = NewType("PeerId", str)

__all__ = ["PeerId", "RequestId"]
