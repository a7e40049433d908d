"""statecore's pure core: phases, events, intents, transition tables, step functions.

Nothing here performs I/O or imports trio, httpx, mlx or mlx_lm.
"""

# The package's public modules (import them by name: nothing is re-exported here, so importing
# the package stays free).
__all__ = [
    "diagram",
    "errors",
    "events",
    "ids",
    "intents",
    "loop",
    "phases",
    "policy",
    "prefix",
    "routing",
    "scheduling",
    "spec",
    "step",
    "table",
]
