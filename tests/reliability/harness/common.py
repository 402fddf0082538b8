"""Markers, the shipped recovery bounds and polling used by every reliability test."""

from __future__ import annotations

from functools import partial

from llmpipe.settings import Settings
from tests.waiting import wait_until as _wait_until

FAULTS = {
    "poison": "POISONPILL",
    "transient": {"FLAKYOOM": 2, "DOOMEDOOM": 1000},
    "crash": "CRASHME",
    "die": "ENGINEDIE",
    "die_always": "KILLSEVERYWORKER",
    "ledger": True,
}
# The shipped defaults (never overridden here): a dead worker's messages are back in the
# queue within RECOVERY_S of its death (llmpipe/broker/leases.py).
LEASE_TTL_S = Settings.model_fields["lease_ttl_s"].default
LEASE_SWEEP_S = Settings.model_fields["lease_sweep_interval_s"].default
RECOVERY_S = LEASE_TTL_S + LEASE_SWEEP_S
# What a bound measured from this process may add: polling every 0.1 s and the sweeping
# thread's scheduling on 2 busy cores.
SLACK_S = 2.0


# the reliability tests poll every 0.1 s (their bounds allow for it: SLACK_S)
wait_until = partial(_wait_until, every=0.1)
