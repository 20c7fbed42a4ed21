"""Arrow kernels: how rows become a shard's updates and how updates are sorted, consolidated, encoded and keyed."""
