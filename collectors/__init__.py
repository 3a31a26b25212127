"""Collectors: turn the machine into samples and events. One collector, one module."""
