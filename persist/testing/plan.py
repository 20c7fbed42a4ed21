"""What a shard machine runs on and with: its location, the faults it may draw, its config.

- ``uri_location(blob_uri, consensus_uri)``: a ``LocationFactory`` (new Blob and Consensus
  handles on one location per call, as another process would open them).
- ``FaultPlan``: the fault levels an example draws from; ``NO_FAULTS`` turns every one off.
- ``machine_config()``: the ``PersistConfig`` the machine's clients use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from persist.config import PersistConfig
from persist.location import Blob, Consensus, open_blob, open_consensus

__all__ = ["NO_FAULTS", "FaultPlan", "LocationFactory", "machine_config", "uri_location"]

LocationFactory = Callable[[], tuple[Blob, Consensus]]
"""Returns new Blob and Consensus handles on one location (each call: like another process)."""


def uri_location(blob_uri: str, consensus_uri: str) -> LocationFactory:
    """A location factory for URIs as ``persist.connect`` takes them."""
    return lambda: (open_blob(blob_uri), open_consensus(consensus_uri))


@dataclass(frozen=True)
class FaultPlan:
    """The faults an example may run with: each example draws one level of each fraction."""

    fail_before: Sequence[float] = (0.0, 0.05, 0.2, 0.4)
    fail_after: Sequence[float] = (0.0, 0.05, 0.2, 0.4)
    latency_s: tuple[float, float] = (0.0, 0.002)
    ops: frozenset[str] | None = None
    # Cancellation of the call under test when it calls its location (``Faults.cancel``).
    cancel: Sequence[float] = (0.0, 0.05, 0.2)
    # Whether steps may cancel the next call after k loop iterations (``arm_cancel``).
    cancel_calls: bool = True
    # Whether a client may stall past its lease (``stall``, ``lost_reply_then_stall``).
    stalls: bool = True
    # Whether data values include NaN, infinities and -0.0.
    special_floats: bool = False


NO_FAULTS = FaultPlan(
    fail_before=(0.0,),
    fail_after=(0.0,),
    latency_s=(0.0, 0.0),
    cancel=(0.0,),
    cancel_calls=False,
    stalls=False,
)


def machine_config(**overrides: Any) -> PersistConfig:
    """The config the machine's clients use: quick polls and retries, frequent rollups, and
    leases long enough that no handle of an example expires on its own."""
    base: dict[str, Any] = {
        "poll_interval_s": 0.01,
        # Pushes may be dropped by the faults: the fallback poll must still find every change.
        "push_poll_interval_s": 0.05,
        "retry_initial_delay_s": 0.001,
        # Few retries, so that failures reach the caller too, not only persist's retry loops.
        "retry_attempts": 2,
        "rollup_interval": 4,
        "lease_duration_s": 3600.0,
        "heartbeat_interval_s": 600.0,
        # Readers alone hold history: the model knows each reader's since exactly, so it
        # checks the shard's since exactly. A run with a retention passes ``retention_s``.
        "retention_s": None,
    }
    base.update(overrides)
    return PersistConfig(**base)
