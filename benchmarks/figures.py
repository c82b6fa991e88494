"""Figures for the CLIs' ``--plot``: matplotlib without a display, and a clear error for a path that
cannot be written (one place for what ``kvstore replay``, ``kvstore simulate`` and ``kvstore bench
offload`` each did for themselves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, *, dpi: int) -> None:
    """Write ``fig`` to ``path`` and close it; a path that cannot be written is a ConfigError naming it."""
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise ConfigError(f"cannot write --plot {path}: {exc.strerror or exc}") from None
    except ValueError as exc:  # a file type matplotlib cannot write (outputs.check_plot refuses it up front)
        raise ConfigError(f"cannot write --plot {path}: {exc}") from None
    finally:
        pyplot().close(fig)
