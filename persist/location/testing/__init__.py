"""The conformance suites every Blob and Consensus implementation must pass.

Subclass them in a ``Test...`` class and supply fixtures only::

    class TestMyBlob(BlobConformance):
        @pytest.fixture
        async def blob(self) -> AsyncIterator[Blob]:
            b = MyBlob(...)
            yield b
            await b.close()

``BlobConformance`` subclasses may override ``leave_partial_write`` (leaves what a writer killed
mid-``set`` leaves behind, for backends that leave anything). ``ConsensusConformance`` subclasses
provide ``consensus`` and may override ``consensus_uri`` (a URI that another process can pass to
:func:`persist.location.open_consensus` to reach the same location, enabling the cross-process
race), ``consensus_factory`` (independent instances over the same location, so racers use
separate connections) and ``consensus_write_lock`` (holds, from another connection, the lock a
compare-and-set waits for, so a cancellation can catch one mid-call), and set
``pushes_changes = True`` when the backend implements ``Consensus.watch``. Never stub a test out;
skip it with a reason.

Every test works in a fresh random namespace (key prefix or consensus key), so a backend may
share one location between tests.
"""

from __future__ import annotations

from persist.location.testing._common import ConsensusFactory, ConsensusWriteLock, PartialWrite
from persist.location.testing.blob import BlobConformance
from persist.location.testing.consensus import ConsensusConformance

__all__ = [
    "BlobConformance",
    "ConsensusConformance",
    "ConsensusFactory",
    "ConsensusWriteLock",
    "PartialWrite",
]
