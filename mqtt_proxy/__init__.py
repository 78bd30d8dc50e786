"""MQTT proxy: the asyncio server over the store, grouped by role (docs/architecture.md draws it).

codec/ the sans-IO MQTT codec; connection/ one client's connection and its packet handlers;
sessions/ session state and registry; delivery/ light queue -> connections; backends/ the layers
below, in process or over the core link; bridge/ MQTT bridges. server.py ties them together.
"""
