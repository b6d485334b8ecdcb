"""The metrics plot (`metrics.png`): one titled panel per series, each drawing that series' points, and pixels
that follow the data."""

from __future__ import annotations

import pytest

from detached_rl.cli.reporting import PLOT_PANELS, plot_metrics

from .helpers import plot_line_pixels, plotted_panels

KEYS = [key for key, _ in PLOT_PANELS]
ROWS = [{"step": 1, KEYS[0]: 0.1, KEYS[1]: 0.02, KEYS[2]: 12.0, KEYS[3]: 0.5},
        {"step": 2, KEYS[0]: 0.3, KEYS[1]: 0.01, KEYS[2]: 9.0, KEYS[3]: 0.25},
        {"step": 3, KEYS[0]: 0.6, KEYS[1]: 0.04, KEYS[2]: 7.0, KEYS[3]: 0.75}]


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures `plot_metrics` draws, kept as it closes them."""
    import matplotlib.pyplot as plt

    closed, close = [], plt.close
    monkeypatch.setattr(plt, "close", lambda figure=None: (closed.append(figure), close(figure)))
    return closed


def test_each_panel_is_titled_and_draws_its_series_points(figures, tmp_path):
    path = plot_metrics(ROWS, tmp_path / "m.png", title="run-7")
    (figure,) = figures
    assert [axis.get_title() for axis in figure.axes] == [label for _, label in PLOT_PANELS]
    assert figure.get_suptitle() == "run-7"
    for axis, key in zip(figure.axes, KEYS, strict=True):
        (line,) = axis.get_lines()
        assert list(line.get_xdata()) == [1, 2, 3] and list(line.get_ydata()) == [row[key] for row in ROWS]
        assert axis.get_xlabel() == "step (policy version)"
    assert plotted_panels(path) == [True, True, True, True]


def test_a_missing_series_leaves_its_panel_empty_and_says_which(figures, tmp_path):
    rows = [{"step": step, KEYS[0]: row[KEYS[0]]} for step, row in enumerate(ROWS, start=1)]
    path = plot_metrics(rows, tmp_path / "m.png")
    (figure,) = figures
    reward, *others = figure.axes
    assert list(reward.get_lines()[0].get_ydata()) == [0.1, 0.3, 0.6]
    for axis, key in zip(others, KEYS[1:], strict=True):
        assert axis.get_lines() == [] and [text.get_text() for text in axis.texts] == [f"no {key!r} recorded"]
    assert plotted_panels(path) == [True, False, False, False]


def test_the_drawn_line_rises_and_falls_with_the_data(tmp_path):
    """Rising rewards draw the reward line low on the left and high on the right; falling ones the reverse."""

    def left_minus_right_height(values: list[float]) -> float:
        rows = [{"step": step, KEYS[0]: value} for step, value in enumerate(values, start=1)]
        points, (height, width) = plot_line_pixels(plot_metrics(rows, tmp_path / f"{values[0]}.png"))
        panel = points[(points[:, 0] < height // 2) & (points[:, 1] < width // 2)]
        middle = (panel[:, 1].min() + panel[:, 1].max()) / 2
        left, right = panel[panel[:, 1] < middle], panel[panel[:, 1] >= middle]
        return float(right[:, 0].mean() - left[:, 0].mean())  # image rows grow downwards

    assert left_minus_right_height([0.0, 0.5, 1.0]) < -50
    assert left_minus_right_height([1.0, 0.5, 0.0]) > 50
