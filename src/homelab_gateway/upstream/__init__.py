"""The client side of an upstream: requests, streamed bodies, connections, probes."""
