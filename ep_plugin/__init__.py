"""ep_plugin: expert-parallel dispatch/combine for Mixture-of-Experts layers."""
from .backends.base import EPEvent, Handle
from .buffer import DispatchResult, EPBuffer
from . import routing
from .config import CommConfig, EPConfig, MoEConfig, OverlapConfig, list_presets, load_config
from .errors import BackendUnavailableError, ConfigError, EPTimeoutError

__version__ = "0.1.0"
