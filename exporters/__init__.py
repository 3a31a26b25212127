"""Exporters (sinks): carry the agent's snapshot and events off the process."""
