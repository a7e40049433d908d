"""Adapters: every concrete I/O (the public API's front end, HTTP, peers, the KV wire codec, the MLX
engine, the CLI).

May import anything; nothing in `statecore` or `effects` may import this package.
"""

# The package's public modules (import them by name: nothing is re-exported here, so importing
# the package stays free).
__all__ = [
    "blas",
    "cli",
    "frontend",
    "grammar",
    "http",
    "kv",
    "metrics",
    "mlx",
    "model_source",
    "serve",
    "tls",
    "tool_calls",
]
