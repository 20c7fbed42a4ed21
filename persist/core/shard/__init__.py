"""A shard's state and its pure transitions: the value, its diff, the transitions, and what they need (clock, history, rollup codec, blob keys, compaction plans, garbage, lifecycle)."""
