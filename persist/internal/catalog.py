"""The catalog in consensus: one value under the key ``catalog``, changed by compare-and-set.

Consensus linearizes it like a shard's state: of two creators of one name, the one whose
compare-and-set lands first wins; the other re-reads, finds the name taken and gets
``InvalidUsage``. A change whose compare-and-set failed indeterminately is re-run on the value
read again, and each change (``core.catalog``) recognizes itself as already done, so a retry
never fails on its own earlier success. When to retry is ``retry.CasRetry``, the rule of a
shard's commits too. Older versions are truncated after each change.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable

from persist.config import PersistConfig, read_clock
from persist.core.catalog import Catalog
from persist.core.shard import codec
from persist.errors import ExternalError
from persist.internal.retry import CasRetry, retry_idempotent
from persist.location import Consensus

CATALOG_KEY = "catalog"


async def read_catalog(consensus: Consensus, cfg: PersistConfig) -> tuple[int | None, Catalog]:
    """The catalog's seqno (None before its first change) and value."""
    head = await retry_idempotent(
        functools.partial(consensus.head, CATALOG_KEY),
        cfg.retry_attempts,
        cfg.retry_initial_delay_s,
    )
    if head is None:
        return None, Catalog()
    return head.seqno, codec.decode_frame(codec.KIND_CATALOG, head.data, Catalog)


async def change_catalog(
    consensus: Consensus, cfg: PersistConfig, change: Callable[[Catalog, int], Catalog | None]
) -> Catalog:
    """Commits ``change(catalog, now_ms)`` (None: nothing to do) and returns the catalog after.

    ``change`` may raise ``InvalidUsage``; it is re-run on the latest catalog after a lost race
    or an indeterminate failure, so it must recognize its own change as done (return None)."""
    rule = CasRetry(cfg.retry_attempts, cfg.retry_initial_delay_s)
    with rule.settling():
        while True:
            seqno, current = await read_catalog(consensus, cfg)
            new = change(current, read_clock(cfg))
            if new is None:
                return current
            data = codec.encode_frame(codec.KIND_CATALOG, new)
            next_seqno = 1 if seqno is None else seqno + 1
            try:
                landed = await consensus.compare_and_set(CATALOG_KEY, seqno, data)
            except ExternalError as exc:
                delay = rule.failed(exc)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                continue
            if not landed:
                rule.lost_race()
                continue
            # Older versions are only space: if this fails, the next change truncates them.
            with contextlib.suppress(ExternalError):
                await consensus.truncate(CATALOG_KEY, next_seqno)
            return new
