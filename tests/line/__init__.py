"""Tests of the line's Twisted side (`homelab_gateway.line`) and of the line's order driven through it."""
