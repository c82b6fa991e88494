"""``kvstore simulate``: routing policies on a request trace in simulated time, no model."""
