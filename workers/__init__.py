"""KV workers: the paged KV tensor pool, the model runner and the Ray actor (in progress)."""
