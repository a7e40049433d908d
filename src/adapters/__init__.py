"""Adapters: every concrete I/O (HTTP, peers, the KV wire codec, the MLX engine, the CLI).

May import anything; nothing in `statecore` or `effects` may import this package.
"""

# The package's public modules (import them by name: nothing is re-exported here, so importing
# the package stays free).
__all__ = [
    "api_keys",
    "blas",
    "cli",
    "grammar",
    "internal_wire",
    "kv_pull",
    "kv_wire",
    "live_view",
    "metrics",
    "mlx",
    "model_source",
    "node_api",
    "openai_api",
    "other_apis",
    "peers_httpx",
    "serve",
    "streaming",
    "tiny_models",
    "tls",
    "tool_calls",
]
