"""Tests of the line's Twisted side (`homelab_gateway.line`), the line's order through it."""
