"""The OpenAI-compatible HTTP protocol that the router and the workers both speak."""
