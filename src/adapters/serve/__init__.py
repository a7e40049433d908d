"""`statecore run`: the serving flags, a node process's wiring, the local cluster supervisor.

`command` resolves the flags (`flags`; the roles that read each, `flag_roles`; their argparse
types, `flag_types`) and starts the role asked for: a node (`node`: engine or
router, its runner and HTTP app, its signal and engine watchers), or, with no role, a local
cluster of child processes (`cluster`). `listeners` binds and hands down the sockets; `logs` sets
up the log lines. May import anything; nothing in `statecore` or `effects` may import this package.
"""

# The package's modules (import them by name: nothing is re-exported here, so importing the
# package stays free).
__all__ = [
    "cluster",
    "command",
    "flag_roles",
    "flag_types",
    "flags",
    "listeners",
    "logs",
    "node",
    "tensor_parallel",
]
