"""The internode backend: a rail hop across nodes, then the node's own backend (backend.py)."""
from .backend import HierarchicalBackend, NvshmemBackend

__all__ = ["HierarchicalBackend", "NvshmemBackend"]
