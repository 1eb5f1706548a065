"""Tests of the web layer (`homelab_gateway.web`): the status page, HTTP's edges, the dashboard."""
