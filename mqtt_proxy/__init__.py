"""MQTT proxy: sans-IO codec (codec/) and the asyncio server over the store."""
