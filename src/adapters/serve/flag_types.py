"""Argparse types for `statecore run`'s flags: each checks a flag's text (a whole number, a
number of seconds, a port, an API key, an origin, ...) and refuses it with one line before
anything loads; a value a local cluster hands on to its nodes is kept as normalized text. This
module starts nothing; it must never import mlx, nor anything that does (`statecore run --help`
loads it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable

from adapters.frontend.openai_bodies import parse_template_args
from adapters.http.api_keys import parse_key, parse_protects

__all__ = ["api_key", "kv_port", "named_adapter", "origins", "protects", "seconds", "template_args", "whole"]


def kv_port(text: str) -> int | None:
    """`--kv-port`: a port number, `auto` (0: any free port) or `off` (None)."""
    if text == "off":
        return None
    if text == "auto":
        return 0
    port = whole(1)(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number")
    return port


def whole(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= minimum (checked before anything loads)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below the least allowed, {minimum}")
        return value

    return parse


def seconds(*, zero_allowed: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 where zero means "at once")."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
            raise argparse.ArgumentTypeError(
                f"{text} is not a usable number of seconds (must be {'>=' if zero_allowed else '>'} 0)")
        return value

    return parse


def api_key(text: str) -> str:
    """An argparse type: one usable API key (the error never repeats it)."""
    try:
        return parse_key(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def protects(text: str) -> str:
    """An argparse type: a comma-separated list of PROTECTABLE names, kept as normalized text (so
    that a local cluster hands it on as given)."""
    try:
        return ",".join(sorted(parse_protects(text)))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def template_args(text: str) -> str:
    """An argparse type: `--chat-template-args`, a JSON object of the chat template's variables
    (`parse_template_args`), kept as normalized JSON text (so that a local cluster hands it on as
    given)."""
    try:
        return json.dumps(parse_template_args(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def named_adapter(text: str) -> str:
    """An argparse type: one `--adapters` entry, NAME=PATH (kept as given: a local cluster hands
    it on)."""
    name, equals, path = text.partition("=")
    if not equals or not path or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", name):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=PATH (a name of 1 to 64 of A-Z a-z 0-9 . _ -)")
    return text


ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s,]+")


def origins(text: str) -> str:
    """An argparse type: `*` or comma-separated origins (`https://app.example.com:8443`: scheme,
    host, port; no path, as browsers send them), kept as normalized text."""
    origins = [o.strip() for o in text.split(",") if o.strip()]
    bad = [o for o in origins if o != "*" and not ORIGIN.fullmatch(o)]
    if not origins or bad:
        raise argparse.ArgumentTypeError(
            f"{bad[0] if bad else text!r} is not an origin: give `*` or scheme://host[:port] "
            "without a path, comma-separated")
    return ",".join(origins)
