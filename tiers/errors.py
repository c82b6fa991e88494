"""Typed errors of the tiers package (callers' mistakes and unusable environments).

Back-pressure and degraded storage are not errors here: a block that cannot
be stored is reported as not stored (``None`` / ``False``) and counted.
"""

from __future__ import annotations

from kvstore.errors import KVStoreError


class TierError(KVStoreError):
    """Base class of every error the tiers raise on purpose."""


class ArenaError(TierError):
    """The shared-memory arena cannot be created or attached (the message says what to change)."""


class InvalidBlockError(TierError, ValueError):
    """Blocks or tensors handed to a tier do not match its cache identity."""


class LeaseError(TierError, ValueError):
    """A lease id that is unknown, already released, or of the wrong kind for the call."""


class TierUnavailableError(TierError):
    """The node's tier did not answer: its actor is dead or unreachable, or its store is closed.

    Not a caller's mistake: a worker stops using the tier, drops what it
    would have spilled, and reconnects later (see ``workers.tier_offload``).
    """


class ArenaMovedError(TierUnavailableError):
    """The tier's arena is not the one the caller mapped: the tier actor was restarted and made a new one.

    A worker that kept copying through its old mapping would read and write
    memory the tier no longer uses (and commit slots it never filled); the
    tier refuses its leases instead, and the worker reconnects and remaps.
    """


class TierTimeoutError(TierUnavailableError, TimeoutError):
    """A tier call passed its deadline (the tier may be alive but stuck)."""
