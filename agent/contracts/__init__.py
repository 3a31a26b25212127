"""The bottom layer: the data model, settings, errors and the collector and sink contracts.

Collectors and exporters import only this layer of agent/ (docs/ARCHITECTURE.md)."""
