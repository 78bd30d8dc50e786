"""One client's connection: the asyncio protocol (TCP/TLS/WebSocket), its packet handlers, inbound batching, keep-alive, limits and closing."""
