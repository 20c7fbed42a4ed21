"""The internal wing: what turns the pure core into a running client.

Nothing here is public API; the names a caller may rely on are what ``persist/__init__.py``
exports. ``shards`` holds a client's shards (their machines and maintenance) and every step a
public call takes before the data path; ``machine`` is the one compare-and-set seam over the
core's transitions; ``retry`` and ``tasks`` are its policies for failures and background work;
``catalog`` is the names' compare-and-set loop; ``lease`` is what both handles share; ``fetch``
and ``batch`` are the data path (parts read from and written to blob); ``report`` is what a
shard's state tells; ``maintenance`` decides which merges, collections and rollups are due and
runs them through ``compact``, ``gc`` and ``erase``.
"""
