"""The streaming-write ledger: durability tiers, the promises a server made, and the transition that commits streamed writes."""
