"""The torch reference backend: torch.distributed all-to-all with bounded waits (backend.py, deadline.py)."""
from .backend import TorchBackend, TorchState

__all__ = ["TorchBackend", "TorchState"]
