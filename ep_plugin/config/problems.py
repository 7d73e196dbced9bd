"""How a config's problems are collected and reported: where a value comes from (Context), one
problem (Problem), and the one ConfigError that lists every problem of a source (config_error).
"""

from __future__ import annotations

import difflib
from typing import Iterable, List

from ..errors import ConfigError


def suggest(key: str, allowed: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``allowed``, or ``""``."""
    close = difflib.get_close_matches(key, list(allowed), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Context:
    """Where the values come from, so that a message names the file or marks an override; and the
    problems found so far, so that one ConfigError reports every problem of a source at once."""

    def __init__(self, source: str, override_keys: Iterable[str] = ()):
        self.source = source
        self.override_keys = set(override_keys)
        self.problems: List[Problem] = []

    def where(self, dotted: str) -> str:
        parts = dotted.split(".")
        # an override of a section (or nested section) covers every key inside it
        if any(".".join(parts[:n]) in self.override_keys for n in range(1, len(parts) + 1)):
            return f"{self.source} (overrides)"
        return self.source

    def fail(self, dotted: str, msg: str) -> ConfigError:
        err = ConfigError(f"{self.where(dotted)}: {dotted}: {msg}")
        err.problems = [Problem(self.where(dotted), dotted, msg)]
        return err

    def note(self, exc: ConfigError) -> None:
        """Keep the problems of ``exc`` (raised by fail() or a check) and go on checking."""
        self.problems += getattr(exc, "problems", None) or [Problem(self.source, "", str(exc))]

    def check(self) -> None:
        """Raise one ConfigError holding every problem noted, if any."""
        if self.problems:
            raise config_error(self.source, self.problems)


class Problem(tuple):
    """One problem of a config: (where: the source, with " (overrides)" for an override; the dotted
    key, "" for the whole source; what is wrong and what is allowed)."""

    def __new__(cls, where: str, key: str, msg: str):
        return super().__new__(cls, (where, key, msg))

    where = property(lambda self: self[0])
    key = property(lambda self: self[1])
    msg = property(lambda self: self[2])

    def line(self) -> str:
        return f"{self.where}: {self.key + ': ' if self.key else ''}{self.msg}"


def config_error(source: str, problems: List[Problem]) -> ConfigError:
    """One ConfigError for ``problems``: the one problem's line, or a first line counting them and one
    indented line each (the source repeated only where it differs, e.g. an override). ``.problems``
    keeps them, so that a caller can merge the problems of several checks of one file."""
    if len(problems) == 1:
        err = ConfigError(problems[0].line())
    else:
        lines = [f"{source}: {len(problems)} problems:"]
        for p in problems:
            where = "" if p.where == source else f"{p.where}: "
            lines.append(f"  {where}{p.key + ': ' if p.key else ''}{p.msg}")
        err = ConfigError("\n".join(lines))
    err.problems = list(problems)
    return err
