"""`python -m ep_plugin <command>` (also the `ep_plugin` console script).

    ep_plugin doctor [--world N] [--json] [--no-ipc] [--config FILE]   what this machine can run, and how to fix what not
"""
from __future__ import annotations

import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "doctor":
        from .doctor import main as doctor

        return doctor(rest)
    print(f"ep_plugin: unknown command {command!r}; commands: doctor", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
