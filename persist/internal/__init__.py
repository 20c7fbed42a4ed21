"""The internal wing: what turns the pure core into a running client.

Nothing here is public API; the names a caller may rely on are what ``persist/__init__.py``
exports. ``machine`` is the one compare-and-set seam over the core's transitions; ``retry`` and
``tasks`` are its policies for failures and background work; ``lease`` is what both handles share;
``maintenance`` decides which merges, collections and rollups are due and runs them through
``compact`` and ``gc``.
"""
