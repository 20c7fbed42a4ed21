"""``MachineStats``: what a shard machine's examples did and found, for a run to report and
for its test to assert that it exercised what it claims to prove."""

from __future__ import annotations

from dataclasses import dataclass, field

from persist.testing.faults import FaultCounts
from persist.testing.model import Audit

__all__ = ["MachineStats"]


@dataclass
class MachineStats:
    """What the machine's examples did and found, summed over examples."""

    examples: int = 0
    steps: int = 0
    steps_with_faults: int = 0
    acknowledged: int = 0
    refused: int = 0
    determinate_errors: int = 0
    indeterminate_errors: int = 0
    resolved_landed: int = 0
    resolved_not_landed: int = 0
    resolved_by_retry: int = 0
    reads_checked: int = 0
    # Of those, reads as of an instant within the retention (``snapshot_at_an_instant``).
    instants_checked: int = 0
    listens_checked: int = 0
    audit_checked: int = 0
    # Examples whose shard a retention let go entirely (sealed, then the window passed).
    audits_skipped: int = 0
    audit_merged: int = 0
    lost: int = 0
    duplicated: int = 0
    wrong: int = 0
    skipped: int = 0
    cancellations: int = 0  # calls under test that ended cancelled
    cancelled_by_iterations: int = 0  # of those, cancelled after k loop iterations
    cancelled_handles_checked: int = 0
    stalls: int = 0
    expired_by_stall: int = 0
    survived_stall: int = 0
    lost_reply_then_stall: int = 0
    worst_loop_stall_ms: float = 0.0
    # Writes of more than one update by a client that stores them as an unsorted run.
    unsorted_writes: int = 0
    faults: FaultCounts = field(default_factory=FaultCounts)
    rules: dict[str, int] = field(default_factory=dict)

    def add_audit(self, audit: Audit) -> None:
        self.audit_checked += audit.checked
        self.audit_merged += audit.merged
        self.lost += audit.lost
        self.duplicated += audit.duplicated
        self.wrong += audit.wrong
