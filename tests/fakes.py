"""Small stand-ins shared by tests."""


class RecordingMonitor:
    """A DeepSpeed monitor that keeps the events it is given (DeepSpeed's MonitorMaster interface)."""

    enabled = True

    def __init__(self):
        self.events = []

    def write_events(self, events):
        self.events += events
