"""Test configuration: hypothesis examples are derandomised in CI so that a run is reproducible."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
