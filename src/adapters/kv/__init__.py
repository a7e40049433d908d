"""The KV cache on the wire: `frames` (the format's framing and header checks, no MLX: any
process may import it), `codec` (caches to host bytes and validated payloads back to caches,
with MLX) and `pull` (a decode node's HTTP pull of a payload straight into one buffer, no MLX).
Nothing in `statecore` or `effects` may import this package."""

# The package's modules (import them by name: nothing is re-exported, so importing the package
# loads no MLX).
__all__ = ["codec", "frames", "pull"]
