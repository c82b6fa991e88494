"""Offload tiers: shared CPU arena and disk files behind a per-node actor (in progress)."""
