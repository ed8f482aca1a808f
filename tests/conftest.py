"""Shared test settings: hypothesis profiles sized for a 2-core machine."""

from __future__ import annotations

import os

import torch
from hypothesis import HealthCheck, settings

settings.register_profile("default", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=400, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("MHA_HYPOTHESIS_PROFILE", "default"))
torch.set_num_threads(min(2, os.cpu_count() or 1))
