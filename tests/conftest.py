"""Settings every test shares: the hypothesis profiles, chosen explicitly, and the `quick` mark.

`pytest -m quick` (README, "Tests") runs every test not marked `e2e` (real processes on
127.0.0.1) or `slow` (a module that starts worker processes, e.g. the cross-process handoff
matrix): the unit, model and integration tests, in under three minutes.

`ci` (the default under CI=true) is derandomized: a run's examples are the same on every
machine and every run, so a red CI is reproducible and a green one is not luck; it does not
shrink, so a red run ends at once (on a busy 2-core machine shrinking a stateful test can take
longer than the per-test timeout) and prints the example as found, with the blob that replays
it (`@reproduce_failure`); the `dev` profile shrinks. `dev` (the
default elsewhere) draws fresh examples each run. `nightly` digs deeper: many more examples
and longer stateful runs. HYPOTHESIS_PROFILE names one explicitly. None has a per-example
deadline: the machine running the suite is often shared, and a slow draw is not a bug.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

_SHARED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("ci", _SHARED, derandomize=True, database=None, max_examples=100,
                          phases=[Phase.explicit, Phase.generate])
settings.register_profile("dev", _SHARED, max_examples=100)
settings.register_profile("nightly", _SHARED, max_examples=2000, stateful_step_count=120)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE")
                      or ("ci" if os.environ.get("CI") == "true" else "dev"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not (item.get_closest_marker("e2e") or item.get_closest_marker("slow")):
            item.add_marker(pytest.mark.quick)
