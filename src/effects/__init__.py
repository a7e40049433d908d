"""Effects: ports, the interpreter of the core's intents, runners and in-memory fakes.

May import `statecore` and trio; never httpx, mlx or mlx_lm.
"""

# The package's public modules (import them by name: nothing is re-exported here, so importing
# the package stays free).
__all__ = [
    "engine_port",
    "fakes",
    "faults",
    "handoffs",
    "health",
    "interpret",
    "kv_pulls",
    "ports",
    "routing",
    "runner",
]
