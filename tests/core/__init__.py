"""The sans-IO core's unit tests, one file per module of `homelab_gateway.core`."""
