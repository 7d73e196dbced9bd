"""ep_plugin: expert-parallel dispatch/combine for Mixture-of-Experts layers."""
from .types import DispatchResult, EPEvent, ExpertDispatchResult, ExpertLayout, Handle
from .buffer import EPBuffer
from . import routing
from .config import CommConfig, EPConfig, MoEConfig, OverlapConfig, list_presets, load_config
from .errors import BackendUnavailableError, ConfigError, EPTimeoutError

__version__ = "0.1.0"
