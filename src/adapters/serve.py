"""`statecore run`: start a node of the chosen role, or a local cluster.

Placeholder until the serving issue lands. This module may import anything.
"""

from __future__ import annotations

import argparse


def run_command(args: argparse.Namespace) -> int:
    print(f"statecore run --role {args.role}: not implemented yet")
    return 0
