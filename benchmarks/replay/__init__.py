"""``kvstore replay``: a request trace replayed against a running router, and what the cache did."""
