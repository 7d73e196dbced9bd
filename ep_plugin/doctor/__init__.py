"""`python -m ep_plugin doctor`: one screen saying what this machine can run, and where not, why and
how to fix it (torch and CUDA, the compiled module and its arch, GPUs and their links, NCCL, the
NVSHMEM wheel, RDMA and IBGDA, CUDA IPC, the NVLink-multicast variables, and which backend `auto`
picks for a world size).

    probe.py   facts about this machine (no verdicts; nothing raises)
    checks.py  verdicts: one ok / warning / error line per subject, with its fix
    report.py  the Check type; text and JSON rendering
    ipc.py     the two-process CUDA IPC test
    rdma_config.py  --config FILE: comm.rdma as the NVSHMEM variables it becomes

`refuse(exc)` is the one-line start-up refusal the examples use when a backend cannot run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import List, NoReturn, Optional

from .checks import run_checks
from .probe import Facts, gather
from .report import ERROR, WARNING, Check, counts, render_json, render_text

__all__ = ["diagnose", "main", "refuse", "Check", "Facts"]


def diagnose(world: Optional[int] = None, ipc: bool = True) -> tuple:
    """(facts, checks) for this machine; `world`: the EP size to pick a backend for."""
    facts = gather(world=world, ipc=ipc)
    return facts, run_checks(facts)


def _footer(facts: Facts, checks: List[Check]) -> str:
    n = counts(checks)
    can = [b for b, why in facts.backends.items() if why is None]
    return (f"can run here: {', '.join(can)}; comm.backend: auto with {facts.world} ranks -> {facts.auto[0]}. "
            f"{n[ERROR]} error(s), {n[WARNING]} warning(s).")


def main(argv=None) -> int:
    from .. import __version__

    p = argparse.ArgumentParser(prog="ep_plugin doctor", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=None,
                   help="EP size to choose a backend for (default: the GPUs here, or 2)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-ipc", action="store_true", help="skip the two-process CUDA IPC test")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a config (YAML path or preset): show its comm.rdma as the NVSHMEM variables it becomes")
    p.add_argument("--local-ranks", type=int, default=None,
                   help="with --config: ranks per host to show the variables for (default: the GPUs here, or 1)")
    args = p.parse_args(argv)
    if args.world is not None and args.world < 1:
        p.error(f"--world must be >= 1, got {args.world}")
    facts, checks = diagnose(world=args.world, ipc=not args.no_ipc)
    if args.config is not None:
        from .rdma_config import rdma_config_check

        local = args.local_ranks if args.local_ranks is not None else max(len(getattr(facts, "gpus", []) or []), 1)
        checks.append(rdma_config_check(args.config, local))
    if args.json:
        print(render_json(checks, ep_plugin=__version__, world=facts.world,
                          auto={"backend": facts.auto[0], "reason": facts.auto[1]},
                          can_run=[b for b, why in facts.backends.items() if why is None]))
    else:
        header = f"ep_plugin {__version__} doctor: what this machine can run"
        print(render_text(checks, header, _footer(facts, checks)))
    return 1 if counts(checks)[ERROR] else 0


def refuse(exc: BaseException, rank: Optional[int] = None) -> NoReturn:
    """End a launched job that cannot start (a backend that cannot run here, an invalid config) with
    one line from rank 0 instead of a traceback per rank; exit status 2."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"ep_plugin: cannot start: {first} (`python -m ep_plugin doctor` says what this machine "
              "can run)", file=sys.stderr, flush=True)
    else:
        # the launcher stops every rank when the first one exits: let rank 0 say why first
        time.sleep(1.0)
    raise SystemExit(2)
