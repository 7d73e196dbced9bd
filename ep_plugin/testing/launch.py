"""Launch checks for ep_plugin's examples: each mistake made when starting one (plain python instead of
torchrun, a world size the experts do not split over, a relative --config from another directory, a
typo in the YAML) ends the job with one line naming the fix, before torch or megatron gets to raise.

    path = config_path(args.config, script=__file__)          # or stop(): where a relative path was looked for
    cfg, own = load_example_config(path, {"train": TRAIN_RULES})  # every problem of the file at once
    require_torchrun(cfg)                                     # or stop(): "start it with torchrun ..."
    check_world_size(cfg)                                     # or stop(): the world sizes that work

Every refusal is one line on stderr from rank 0 (a multi-problem config: one line per problem), exit
status 2; the other ranks wait a second so that rank 0's line comes first.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, Mapping, NoReturn, Optional, Sequence, Tuple

from ..config import EPConfig, load_config, preset_path
from ..config.io import read_with_problems
from ..config.problems import Context, config_error
from ..config.validate import check_section, divisors
from ..errors import BackendUnavailableError, ConfigError

REPO = Path(__file__).resolve().parents[2]  # a source checkout: examples/ beside ep_plugin/


def _script() -> str:
    return sys.argv[0] if sys.argv and sys.argv[0] else "this example"


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def stop(message: Any, rank: Optional[int] = None) -> NoReturn:
    """End the job: ``message`` (a string or an exception: its whole text, every problem of a config
    file; for a backend that cannot run here, a pointer to the doctor) on stderr from rank 0,
    prefixed with the script's name; exit status 2. The other ranks exit after a second (the launcher stops
    every rank when the first one exits: rank 0 says why first)."""
    rank = _rank() if rank is None else rank
    if rank == 0:
        text = str(message).strip() or type(message).__name__
        if isinstance(message, BackendUnavailableError):
            text += " (`python -m ep_plugin doctor` says what this machine can run)"
        print(f"{_script()}: {text}", file=sys.stderr, flush=True)
    else:
        time.sleep(1.0)
    raise SystemExit(2)


def _short(path: Path) -> str:
    """``path`` relative to the current directory when that is shorter, else absolute."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return str(path)
    return rel if len(rel) < len(str(path)) else str(path)


def config_path(arg: str, script: str, presets: bool = True) -> str:
    """The file ``--config arg`` names: a path (a relative one is resolved from the current directory,
    as a shell would), or with ``presets`` a preset name (``tiny``, ``deepseek_v3``). When there is no
    such file: stop() with one line saying where it was looked for and, when the same name exists
    beside the script or in the repository, the --config that finds it."""
    p = Path(arg).expanduser()
    if p.is_file():
        return str(p)
    if presets and os.sep not in arg and "/" not in arg:
        try:
            return str(preset_path(arg))
        except ConfigError:
            pass
    here = Path(script).resolve().parent
    cands = [here / arg, here / p.name, REPO / arg, REPO / "configs" / p.name]
    found = next((c for c in cands if not p.is_absolute() and c.is_file()), None)
    where = (f"a relative path is resolved from the directory you start in, {os.getcwd()}"
             if not p.is_absolute() else "an absolute path")
    hint = f"; did you mean --config {_short(found)}?" if found else ""
    if presets and not found:
        from ..config import list_presets

        hint = f"; give a path to a YAML file or a preset name ({', '.join(list_presets())})"
    stop(f"--config {arg}: no such file ({where}){hint}")


def load_example_config(path: str, sections: Mapping[str, Tuple[Mapping[str, Tuple[str, Any]], Sequence[str], str]],
                        overrides: Optional[Mapping] = None) -> Tuple[EPConfig, Dict[str, Dict[str, Any]]]:
    """An example's YAML: its own ``sections`` (name -> (rules, other allowed keys, what those are);
    rules as in ep_plugin.config.validate.RULES) and ep_plugin's (moe, comm, overlap), checked together:
    one ConfigError lists every problem of the file (keys written twice, typos with a did-you-mean,
    wrong types, allowed values), each naming the file. Returns (the EPConfig, {section: checked values})."""
    raw, problems = read_with_problems(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    raw = dict(raw)
    ctx = Context(str(path))
    ctx.problems += problems
    own = {}
    for sec, (rules, other_keys, other_are) in sections.items():
        own[sec] = check_section(ctx, sec, raw.pop(sec, None), rules, other_keys, other_are)
    cfg = None
    try:
        cfg = load_config(raw, overrides, source=str(path))
    except ConfigError as exc:
        ctx.note(exc)
    if ctx.problems:
        raise config_error(str(path), ctx.problems)
    return cfg, own


def world_sizes(cfg: EPConfig, near: int = 2) -> Tuple[int, str]:
    """(the process count nearest ``near`` that the experts split over evenly, a phrase naming the
    other counts that work) for an example that runs EP = world size."""
    e = cfg.moe.num_experts
    ok = divisors(e)
    best = min(ok, key=lambda n: (abs(n - near), n))
    others = [str(n) for n in ok if n != best]
    also = f"{', '.join(others[:-1])} or {others[-1]}" if len(others) > 1 else "".join(others)
    return best, (f"{also} work too for its {e} experts" if others else f"the only count for its {e} experts")


def require_torchrun(cfg: Optional[EPConfig] = None, nproc: int = 2) -> None:
    """stop() with "start it with torchrun --nproc-per-node N" unless a launcher (torchrun, deepspeed)
    started this process or a process group exists already: without RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT, torch would raise "environment variable RANK expected"."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if not missing:
        return
    n, also = world_sizes(cfg) if cfg is not None else (nproc, "")
    stop(f"start it with torchrun --nproc-per-node {n} {_script()} (one process per rank; plain python "
         f"sets no {'/'.join(missing)}){'; ' + also if also else ''}", rank=0)


def check_world_size(cfg: EPConfig, world: Optional[int] = None, what: str = "expert-parallel size = world size") -> None:
    """stop() unless the experts split evenly over ``world`` ranks (default: the launcher's WORLD_SIZE
    or the process group's size), naming the process counts that work."""
    if world is None:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else int(
            os.environ.get("WORLD_SIZE", "1"))
    e = cfg.moe.num_experts
    if e % world == 0:
        return
    n, also = world_sizes(cfg, world)
    stop(f"{cfg.source}: moe.num_experts = {e} does not split over {world} processes ({what}): "
         f"start it with torchrun --nproc-per-node {n} ({also})")
