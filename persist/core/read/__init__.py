"""Questions reads ask of a shard's state: which parts a snapshot, a split or a range needs, and how an engine may read them."""
