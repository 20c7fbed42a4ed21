"""Test tools for persist, for its own suite and for yours.

- ``persist.testing.strategies``: Hypothesis strategies for schemas, rows and updates.
- ``persist.testing.model``: ``ShardModel``, the contract's semantics of a shard in plain Python.
- ``persist.testing.faults``: ``FaultyBlob`` / ``FaultyConsensus`` around any location, driven
  by a ``Faults`` config (seeded failures before or after the call took effect, latency, pause).
- ``persist.testing.machine``: ``shard_machine(location)`` / ``run_shard_machine``, a Hypothesis
  state machine driving real handles against the model, with faults, cancellations and stalls
  on. Its parts: ``driver`` (an example's state, its calls under test, its final audit),
  ``judge`` (whether a write landed, from what its caller was told), the rules
  (``handle_rules``, ``read_rules``, ``write_rules``, ``fault_rules``), ``plan``
  (``FaultPlan``, ``machine_config``, ``uri_location``) and ``stats`` (``MachineStats``).
- ``persist.testing.cancel``: ``under_test(call, faults, cancel_after=k)``, cancelling a call
  at a location call (``Faults(cancel=p)``) or after k loop iterations.
- ``persist.testing.stall``: ``ManualClock``, a ``now_ms`` that a test moves past a lease.
- ``persist.testing.lag``: ``LoopLag``, the worst event-loop stall seen by a 1 ms ticker.
- ``persist.testing.hostile``: hostile arguments for every public call (wrong types, sizes,
  NaN/inf/-0.0, lone surrogates, out-of-range ints, forged bytes, bad configs).
- ``scale()`` / ``scaled(n)``: counts scaled by ``PERSIST_TEST_SCALE`` (1 by default).

Hypothesis is needed (``pip install 'persist-shards[test]'``). The location conformance suite for Blob
and Consensus implementations is ``persist.location.testing``.
"""

from __future__ import annotations

from persist.testing.faults import FaultCounts, Faults, FaultyBlob, FaultyConsensus
from persist.testing.machine import (
    NO_FAULTS,
    FaultPlan,
    LocationFactory,
    MachineStats,
    ShardMachine,
    machine_config,
    run_shard_machine,
    shard_machine,
    uri_location,
)
from persist.testing.model import Audit, ShardModel, Write, contents_of, table_updates
from persist.testing.scale import ENV_SCALE, scale, scaled

__all__ = [
    "ENV_SCALE",
    "NO_FAULTS",
    "Audit",
    "FaultCounts",
    "FaultPlan",
    "Faults",
    "FaultyBlob",
    "FaultyConsensus",
    "LocationFactory",
    "MachineStats",
    "ShardMachine",
    "ShardModel",
    "Write",
    "contents_of",
    "machine_config",
    "run_shard_machine",
    "scale",
    "scaled",
    "shard_machine",
    "table_updates",
    "uri_location",
]
