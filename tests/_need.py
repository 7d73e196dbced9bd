"""What a test needs, with one rule: a machine that lacks it skips; a broken build fails.

A test that needs the NVSHMEM part of ep_plugin._C skips without enough CUDA GPUs. On a machine that
has them and where the nvidia-nvshmem wheel is importable, a _C without its NVSHMEM part (or no _C
at all) is a broken build, so the test fails and says why the build left NVSHMEM out (setup.py's own
find_nvshmem, run here), instead of skipping quietly. A test module that needs a framework skips where
it is not installed, and an installed one that fails to import fails the tests that import it.
"""
from __future__ import annotations

import ast
import importlib.util
import os

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def installed(module: str) -> bool:
    """Whether ``module`` (dotted: a package's submodule) is installed, found without importing it or its
    packages: a package's __init__ runs nothing here."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not rest:
        return spec is not None
    for base in spec.submodule_search_locations or ():
        path = os.path.join(base, *rest)
        if os.path.exists(path + ".py") or os.path.isdir(path):
            return True
    return False


def need_installed(*modules: str) -> None:
    """At a test module's top: skip the module where one of ``modules`` is not installed. It is not
    imported here: megatron-core and DeepSpeed cost every xdist worker 2-4 s of CPU at collection, and
    most of these modules use them only in their ranks (pytest.importorskip imported them)."""
    for module in modules:
        if not installed(module):
            pytest.skip(f"{module} is not installed", allow_module_level=True)


def need_gpus(n: int = 1) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU{'s' if n > 1 else ''}")


def nvshmem_wheel_importable() -> bool:
    return importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.nvshmem") is not None


def build_reason() -> str:
    """Why setup.py builds _C without NVSHMEM on this machine (its find_nvshmem), or why that is unknown."""
    path = os.path.join(ROOT, "setup.py")
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        # the imports and the finder functions only: running setup.py would call setup()
        keep = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.FunctionDef) and n.name in ("find_cuda_home", "cuda_major", "find_nvshmem"))]
        ns = {"__file__": path}
        exec(compile(ast.Module(body=keep, type_ignores=[]), path, "exec"), ns)
        cuda = ns["find_cuda_home"]()
        found, reason = ns["find_nvshmem"](cuda)
        if found is not None:
            return (f"setup.py finds the NVSHMEM wheel here ({found[1]}), so _C was built elsewhere or before "
                    "the wheel was installed: rebuild (pip install --no-build-isolation --no-deps -e .)")
        return f"setup.py: {reason}"
    except Exception as exc:  # noqa: BLE001  (the reason is a courtesy; the failure stands without it)
        return f"(setup.py's find_nvshmem could not be run here: {exc!r})"


def need_nvshmem(world: int = 1) -> None:
    """Skip without `world` CUDA GPUs; fail when the NVSHMEM wheel is there but _C lacks NVSHMEM; skip
    only where the wheel is absent (a machine that cannot have the NVSHMEM part)."""
    need_gpus(world)
    import ep_plugin._ext as ext

    has = ext.has_c() and bool(getattr(ext.get_c(), "HAS_NVSHMEM", False))
    if has:
        return
    what = ("ep_plugin._C is not built" if not ext.has_c() else "ep_plugin._C is built without NVSHMEM")
    if nvshmem_wheel_importable():
        pytest.fail(f"{what}, though CUDA GPUs are here and the nvidia-nvshmem wheel is importable: a broken "
                    f"build, not a reason to skip. {build_reason()}", pytrace=False)
    pytest.skip(f"{what} (the nvidia-nvshmem wheel is not importable)")
