"""Hypothesis profiles: CI replays a fixed set of examples, so a red run is reproducible; a
developer's run explores new ones. Neither has a per-example deadline: a 2-core machine busy
with the daemon tests is not a slow test."""

import os

from hypothesis import settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
