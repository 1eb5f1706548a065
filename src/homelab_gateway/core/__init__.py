"""The sans-IO core: protocols, mappings and the line's decisions, as plain Python.

Nothing here imports Twisted, treq, klein, txredisapi or prometheus_client
(`tests/core/test_core_imports.py` holds every module to that): input in, events or decisions out.
"""
