"""Backends: one contract (base.py), one registry that names them and picks one (registry.py)."""
from .base import Backend, Capabilities
from .registry import BACKEND_NAMES, backend_class, choose_backend, make_backend

__all__ = ["Backend", "Capabilities", "BACKEND_NAMES", "backend_class", "choose_backend", "make_backend"]
