"""A doctor's verdicts: one Check per line (ok / warning / error, what was found, how to fix it),
rendered as one screen of text or as JSON for scripts."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import List, Optional

OK, WARNING, ERROR = "ok", "warning", "error"


@dataclass
class Check:
    name: str
    status: str                  # OK | WARNING | ERROR
    summary: str                 # what was found, one line
    fix: Optional[str] = None    # what to do about a warning or error
    details: List[str] = field(default_factory=list)  # extra lines (matrices, per-backend answers)


def counts(checks: List[Check]) -> dict:
    return {s: sum(c.status == s for c in checks) for s in (OK, WARNING, ERROR)}


def render_text(checks: List[Check], header: str, footer: str) -> str:
    width = max(len(c.name) for c in checks)
    lines = [header]
    for c in checks:
        lines.append(f"  {c.status:<8} {c.name:<{width}}  {c.summary}")
        pad = " " * (13 + width)
        lines += [f"{pad}{d}" for d in c.details]
        if c.fix and c.status != OK:
            lines.append(f"{pad}fix: {c.fix}")
    lines.append(footer)
    return "\n".join(lines)


def render_json(checks: List[Check], **extra) -> str:
    return json.dumps({**extra, "counts": counts(checks), "checks": [asdict(c) for c in checks]}, indent=1)
