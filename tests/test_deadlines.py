"""The suite's deadlines scale with the machine (`tests/deadlines.py`), never below the reference's."""

from __future__ import annotations

import pytest

from tests import deadlines


@pytest.fixture(autouse=True)
def fresh_measurement():
    deadlines.slowness.cache_clear()
    yield
    deadlines.slowness.cache_clear()


def test_a_set_scale_is_taken_and_never_shrinks_a_bound(monkeypatch):
    monkeypatch.setenv(deadlines.SCALE_VARIABLE, "1.8")
    assert deadlines.scaled(30) == pytest.approx(54)
    monkeypatch.setenv(deadlines.SCALE_VARIABLE, "0.5")  # a faster machine keeps the reference's bound
    deadlines.slowness.cache_clear()
    assert deadlines.scaled(30) == 30


def test_the_measured_scale_is_the_start_up_time_against_the_reference(monkeypatch):
    monkeypatch.delenv(deadlines.SCALE_VARIABLE, raising=False)
    measured = deadlines.startup_seconds()
    assert measured > 0
    assert deadlines.slowness() == pytest.approx(max(1.0, measured / deadlines.REFERENCE_STARTUP_S))
