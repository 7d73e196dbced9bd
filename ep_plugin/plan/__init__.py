"""Planning helpers that need no GPU: the internode cost model (``cost_model``, docs/COST_MODEL.md).

Imported lazily, so that ``python -m ep_plugin.plan.cost_model`` runs the module once.
"""

__all__ = ["HARDWARE", "Fanout", "Hardware", "fanout", "fanout_of", "predict", "suggest"]


def __getattr__(name):
    if name in __all__:
        from . import cost_model

        return getattr(cost_model, name)
    raise AttributeError(f"module 'ep_plugin.plan' has no attribute {name!r}")
