"""Communication telemetry of EPBuffer (`comm.stats: true`).

    recorder.py  CommStats: per-call times (CUDA events read lazily, host timers on CPU), bytes per
                 domain (local / remote), rows per rank and per expert, timeouts; `summary()`
    proxy.py     RecordingBackend: the backend seam through which every exchange is recorded
    report.py    collect() over an EP group (slowest rank, imbalance, bytes sent per step remote /
                 local), Report.line(), and the IntervalReporter the framework integrations report
                 through every N steps
    bench.py     `python -m ep_plugin.telemetry.bench`: what recording costs per call

With `comm.stats: false` (the default) none of this is on a call's path.
"""
from .proxy import RecordingBackend
from .recorder import CommStats, imbalance
from .report import IntervalReporter, Report, collect, log_to, merge, training_step

__all__ = ["CommStats", "RecordingBackend", "Report", "IntervalReporter", "collect", "imbalance", "log_to",
           "merge", "training_step"]
