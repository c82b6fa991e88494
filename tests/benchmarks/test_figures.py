"""``--plot`` output shared by replay, simulate and bench offload: a written PNG, or a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.benchmarks.figures import pyplot, save_figure
from kvstore.errors import ConfigError


def test_save_figure_writes_a_png_and_closes_the_figure(tmp_path: Path) -> None:
    plt = pyplot()
    fig, axis = plt.subplots()
    axis.plot([1, 2, 3])
    save_figure(fig, tmp_path / "plot.png", dpi=50)
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)


def test_save_figure_names_a_path_it_cannot_write(tmp_path: Path) -> None:
    plt = pyplot()
    fig, _ = plt.subplots()
    target = tmp_path / "no-such-dir" / "plot.png"
    with pytest.raises(ConfigError, match=r"cannot write --plot .*no-such-dir/plot\.png: No such file or directory"):
        save_figure(fig, target, dpi=50)
    assert not plt.fignum_exists(fig.number)  # closed even when writing failed
