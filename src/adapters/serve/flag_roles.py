"""Which roles of `statecore run` read which flags: the groups `--help` lists the flags under
(`FlagGroup`: what they are for, and the roles that read them), each flag's readers
(`roles_reading`), and one line for a flag given to a role that ignores it
(`flags_for_other_roles`). This module starts nothing; it must never import anything but the
standard library (every module that declares or reads flags imports it).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

__all__ = [
    "API",
    "CLUSTER",
    "ENGINE",
    "FLAG_GROUPS",
    "HANDOFF",
    "LIMITS",
    "LOGGING",
    "MEMORY",
    "PARALLEL",
    "ROLES",
    "ROUTER",
    "SECURITY",
    "SERVE",
    "FlagGroup",
    "flag_group",
    "flags_for_other_roles",
    "role_words",
    "roles_reading",
]


ROLES = ("cluster", "single", "prefill", "decode", "router")
"""`--role`'s choices; "cluster" (the default) is a local router + prefill + decode."""

_ENGINE = frozenset({"cluster", "single", "prefill", "decode"})
_PUBLIC = frozenset({"cluster", "single", "router"})
_EVERY = frozenset(ROLES)


@dataclass(frozen=True, slots=True)
class FlagGroup:
    """A part of `statecore run --help`: what its flags are for and which roles read them (a
    local cluster reads what any of its nodes reads and hands each node its own)."""

    title: str
    roles: frozenset[str]
    description: str = ""


SERVE = FlagGroup("what to serve and where", _EVERY)
CLUSTER = FlagGroup("local cluster (no --role)", frozenset({"cluster"}),
                    "the prefill and decode nodes a local cluster starts on 127.0.0.1")
ROUTER = FlagGroup("router: where each request goes", frozenset({"cluster", "router"}))
API = FlagGroup("public API: keys, browsers, usage (single, router)", _PUBLIC)
ENGINE = FlagGroup("engine: batching and compute (single, prefill, decode)", _ENGINE,
                   "every node of a cluster needs the same values of the flags marked so")
MEMORY = FlagGroup("engine: KV memory and the prefix cache (single, prefill, decode)", _ENGINE)
HANDOFF = FlagGroup("KV handoff between nodes (prefill, decode)", frozenset({"cluster", "prefill", "decode"}))
PARALLEL = FlagGroup("one instance over several processes (single, prefill, decode)", _ENGINE)
SECURITY = FlagGroup("security between nodes (every role)", _EVERY)
LIMITS = FlagGroup("time limits and admission (every role)", _EVERY)
LOGGING = FlagGroup("logs (every role)", _EVERY)
FLAG_GROUPS = (SERVE, CLUSTER, ROUTER, API, ENGINE, MEMORY, HANDOFF, PARALLEL, SECURITY, LIMITS, LOGGING)

_ROLES_OF_FLAG = {
    # flags whose roles are narrower than their group's
    "prefill": frozenset({"router"}), "decode": frozenset({"router"}),  # a local cluster names its own
    "trust_remote_code": _ENGINE, "blas": _ENGINE,
    "keep_conversations": frozenset({"cluster", "single", "decode"}),
    "speculative": frozenset({"cluster", "single", "decode"}),
    "num_draft_tokens": frozenset({"cluster", "single", "decode"}),
    "speculative_max_rows": frozenset({"cluster", "single", "decode"}),
    "draft_model": frozenset({"cluster", "single", "decode"}),
    "prefix_pull": frozenset({"cluster", "prefill"}),
    "kv_shm_bytes": frozenset({"cluster", "prefill"}),
    "preallocate_slots": frozenset({"cluster", "single", "decode"}),
}


def flag_group(parser: argparse.ArgumentParser, group: FlagGroup) -> argparse._ArgumentGroup:
    """The parser's argument group for `group` (made on first use), so that `--help` lists each
    flag under what it is for and the roles that read it."""
    for existing in parser._action_groups:
        if existing.title == group.title:
            return existing
    return parser.add_argument_group(group.title, group.description or None)


def roles_reading(parser: argparse.ArgumentParser) -> dict[str, frozenset[str]]:
    """Each flag's destination -> the roles that read it, from the groups it was declared in."""
    by_title = {group.title: group.roles for group in FLAG_GROUPS}
    roles: dict[str, frozenset[str]] = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            roles[action.dest] = _ROLES_OF_FLAG.get(action.dest, by_title.get(group.title or "", _EVERY))
    return roles


def role_words(role: str) -> str:
    """A role as a start-up line names it."""
    return {"cluster": "local cluster", "router": "router"}.get(role, f"{role} node")


def flags_for_other_roles(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """One line for each flag given (set to other than its default) that `args.role` does not
    read: it is ignored there, as before (a local cluster hands its nodes their own flags), but a
    person who typed it should know."""
    lines: list[str] = []
    readers = roles_reading(parser)
    for action in parser._actions:
        roles = readers.get(action.dest, _EVERY)
        if args.role in roles or getattr(args, action.dest, action.default) == action.default:
            continue
        flag = action.option_strings[0]
        who = ", ".join(role_words(r) for r in ROLES if r in roles)
        lines.append(f"{role_words(args.role)}: {flag} is read by the {who} only and is "
                     f"ignored here; drop it, or start the role that reads it (statecore run --role "
                     f"{args.role} --help lists this role's flags)")
    return lines
