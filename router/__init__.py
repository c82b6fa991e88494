"""Cache-aware router: prefix index rebuilt from KV events, scoring, HTTP front."""
