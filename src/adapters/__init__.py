"""Adapters: every concrete I/O (HTTP, peers, the KV wire codec, the MLX engine, the CLI).

May import anything; nothing in `statecore` or `effects` may import this package.
"""

__all__: list[str] = []
