"""Tests of the upstream client and its connections (`homelab_gateway.upstream`)."""
