"""Tests of the surfaces (`homelab_gateway.surfaces`): the Messages API and the reverse proxy."""
