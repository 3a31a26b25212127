"""gpuwarden: the agent runtime (configuration, data model, scheduler, state, command line)."""

__version__ = "0.1.0"
