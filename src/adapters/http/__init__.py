"""HTTP: what nodes serve and how they call each other. API keys for the public API (which is
`adapters.frontend`), the node's internal API (`node_api`, put together from `node_status`,
`node_requests`, `kv_handoff` and `prefix_blocks`, each route guarded by `internal_wire`; how a
prefill node's KV leaves it, a payload's body or a stream's records, is `kv_send`'s) and its wire
models, the live view, streaming responses that notice a gone client, and the httpx client that
calls peers (`peers_httpx`), beside the reads of a peer's KV that go around httpx (`kv_receive`;
the KV itself travels through `adapters.kv` (`pull`, `frames`, `codec`)).

May import anything; nothing in `statecore` or `effects` may import this package.
"""

# The package's modules (import them by name: nothing is re-exported here, so importing the
# package stays free).
__all__ = [
    "api_keys",
    "internal_wire",
    "kv_handoff",
    "kv_receive",
    "kv_send",
    "live_view",
    "node_api",
    "node_requests",
    "node_status",
    "peers_httpx",
    "prefix_blocks",
    "segment_copies",
    "streaming",
]
