"""Tests of the web layer (`homelab_gateway.web`): the status page, the edges of HTTP, the dashboard."""
