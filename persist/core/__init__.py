"""The sans-I/O core of persist, in four wings: ``shard`` (a shard's state, its diff and its
transitions), ``read`` (questions reads ask of the state), ``stream`` (the streaming-write
ledger) and ``arrow`` (Arrow kernels); and three modules they share or that join them:
``frontier``, ``catalog`` and ``erasure``.

Nothing here awaits, sleeps, reads a clock, makes ids or touches a location.
"""
