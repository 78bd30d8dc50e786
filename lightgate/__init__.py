"""Lightgate: CLI, configuration and the wiring of store, light queues, notify and proxies."""

__version__ = "0.1.0"
