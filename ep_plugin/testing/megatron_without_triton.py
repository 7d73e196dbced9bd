"""A stand-in for the one megatron-core module that imports triton on a CPU model's path.

megatron-core 0.19.2 imports triton unconditionally on the way to GPTModel (gpt_model -> moe/paged_stash
-> moe/ops/paged_stash.py, whose two triton kernels serve the paged activation stash, a GPU-only
option). triton is ~1 GB installed and runs on no CPU. ``scripts/setup.sh --light`` installs no triton
and copies this file into site-packages (as ``_ep_plugin_megatron_without_triton``, imported by a
``.pth`` line at start-up): when that module is imported and triton is not installed, a module with
the same names stands in for it, whose kernels raise a RuntimeError saying what to install if they are
ever launched. With triton installed it does nothing. Self-contained on purpose: a ``.pth`` line runs
at every interpreter start, so it imports neither torch nor ep_plugin.
"""
import importlib.abc
import importlib.machinery
import importlib.util
import sys

TARGET = "megatron.core.transformer.moe.ops.paged_stash"
GLOBAL_BLOCK_SIZE = 1024  # megatron's value, imported by megatron/core/transformer/moe/paged_stash.py


class _NeedsTriton:
    """A triton kernel that cannot run here: launching it (kernel[grid](...)) says why."""

    def __init__(self, name):
        self.__name__ = name

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"megatron-core's {self.__name__} (paged activation stash, GPU only) needs triton, "
                           f"which scripts/setup.sh --light does not install: pip install triton")

    __call__ = _refuse

    def __getitem__(self, grid):
        return self._refuse


class _Loader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.GLOBAL_BLOCK_SIZE = GLOBAL_BLOCK_SIZE
        module.paged_stash_copy_kernel = _NeedsTriton("paged_stash_copy_kernel")
        module.paged_stash_pop_kernel = _NeedsTriton("paged_stash_pop_kernel")
        module.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
        module.EP_PLUGIN_STAND_IN = True


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        try:
            if importlib.util.find_spec("triton") is not None:
                return None  # triton is installed: megatron's own module
        except (ImportError, ValueError):
            pass
        return importlib.machinery.ModuleSpec(name, _Loader(), origin="ep_plugin stand-in (no triton)")


def install():
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) or type(f).__name__ == "_Finder" and getattr(f, "_ep_plugin", False)
               for f in sys.meta_path):
        finder = _Finder()
        finder._ep_plugin = True
        sys.meta_path.insert(0, finder)


install()
