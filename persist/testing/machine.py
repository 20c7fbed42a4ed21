"""A Hypothesis state machine that drives real persist handles against the reference model.

``shard_machine(location)`` returns a ``RuleBasedStateMachine`` class. Each example opens two
clients (two "processes") on one fresh shard of the location, with the location's Blob and
Consensus wrapped in fault injectors (``persist.testing.faults``), and runs random steps:
open writers and readers, ``compare_and_append`` (right, stale and ahead of the upper),
``append``, ``batch`` + ``compare_and_append_batch`` (moved between clients as bytes), two
writers racing one upper, ``snapshot`` (whole or in splits fetched by the other client),
``listen``, ``downgrade_since``, ``expire``, ``maintain``, a client restart, and a write held by
a paused location, a client stalling past its lease, and cancellations of the calls under test
(``persist.testing.cancel``). After each step the handles must agree with :class:`ShardModel`:

- an acknowledged write is in every later read, exactly once;
- a refusal (``UpperMismatch``, ``InvalidUsage``) or a determinate ``ExternalError`` changed
  nothing; a read never fails indeterminately;
- after an indeterminate ``ExternalError``, a cancellation, or (after a stall) ``LeaseExpired``,
  a read of the upper (or the same call retried) tells whether it happened, and it happened at
  most once; a handle whose call was cancelled goes on working;
- after a stall, a handle goes on working or raises ``LeaseExpired`` (then it is dropped).

At the end of an example a fresh client, with faults off, reads everything back and audits
every acknowledged write (present / lost / duplicated). Use it as::

    from hypothesis import settings
    from persist.testing import shard_machine, uri_location

    TestShard = shard_machine(uri_location("mem://t", "mem://t")).TestCase
    TestShard.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)

Each example runs on its own event loop; don't use it from inside a running loop.

The machine is built of modules with one job each: ``persist.testing.driver`` (an example's state,
its calls under test, its final audit), ``persist.testing.judge`` (whether a write landed, from
what its caller was told), and the rules: ``handle_rules``, ``read_rules``, ``write_rules`` and
``fault_rules``. ``persist.testing.plan`` and ``persist.testing.stats`` hold the knobs and the
figures. A new operation is a new rule in one of the rule modules (see ``driver`` for how one
reads).
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from persist.config import PersistConfig
from persist.testing.fault_rules import FaultRules
from persist.testing.plan import NO_FAULTS, FaultPlan, LocationFactory, machine_config, uri_location
from persist.testing.read_rules import ReadRules
from persist.testing.stats import MachineStats
from persist.testing.write_rules import WriteRules

__all__ = [
    "NO_FAULTS",
    "FaultPlan",
    "LocationFactory",
    "MachineStats",
    "ShardMachine",
    "machine_config",
    "run_shard_machine",
    "shard_machine",
    "uri_location",
]


# FaultPlan is frozen: one instance serves every call as the default.
_EVERY_FAULT = FaultPlan()


class ShardMachine(WriteRules, ReadRules, FaultRules):
    """Random operations on one shard by two clients, checked against ``ShardModel``.

    Configure a subclass with ``shard_machine``; its knobs are the class attributes of
    ``persist.testing.driver.MachineBase``.
    """


def shard_machine(
    location: LocationFactory,
    *,
    plan: FaultPlan = _EVERY_FAULT,
    config: PersistConfig | None = None,
    stats: MachineStats | None = None,
    name: str = "ShardMachineOn",
) -> type[ShardMachine]:
    """A ``ShardMachine`` subclass running on ``location`` with faults drawn from ``plan``.

    ``stats`` (a fresh ``MachineStats`` by default, at ``cls.stats``) sums what its examples did.
    """
    attrs: dict[str, Any] = {
        "location": staticmethod(location),
        "plan": plan,
        "config": config or machine_config(),
        "stats": stats or MachineStats(),
    }
    return type(name, (ShardMachine,), attrs)


def run_shard_machine(
    location: LocationFactory,
    *,
    max_examples: int,
    steps: int = 30,
    plan: FaultPlan = _EVERY_FAULT,
    config: PersistConfig | None = None,
    stats: MachineStats | None = None,
    hypothesis_settings: settings | None = None,
    name: str = "ShardMachineOn",
) -> MachineStats:
    """Runs ``max_examples`` examples of up to ``steps`` steps; returns what they did.

    ``name`` names the machine class, which keys Hypothesis's example database: give each
    location its own, so a failure saved on one is not replayed on another.
    """
    machine = shard_machine(location, plan=plan, config=config, stats=stats, name=name)
    base = hypothesis_settings or settings(deadline=None)
    for attempt in range(3):
        started = machine.stats.examples
        try:
            run_state_machine_as_test(
                machine,
                settings=settings(base, max_examples=max_examples, stateful_step_count=steps),
            )
            break
        except SystemError as exc:
            # CPython 3.11 can fail ast.parse with this in threaded programs (gh-106905);
            # Hypothesis parses the machine's source before the first example. Only that
            # spurious failure, before any example ran, is tried again.
            spurious = "AST constructor recursion depth mismatch" in str(exc)
            if not spurious or machine.stats.examples != started or attempt == 2:
                raise
    return machine.stats
