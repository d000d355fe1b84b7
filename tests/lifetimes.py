"""Session resources (engines, servers) stopped right after the last test that uses them, so the
memory and the cores they hold go to the tests after it rather than waiting for the end of the
session. The root ``conftest.py`` calls ``release_finished`` after each test."""

from __future__ import annotations

from collections.abc import Callable

_RELEASES: dict[str, Callable[[], None]] = {}


def release_after_last_use(fixture_name: str, stop: Callable[[], None]) -> None:
    """Call ``stop`` once the last collected test using ``fixture_name`` has finished (the
    fixture's own teardown still runs at the end of the session: ``stop`` must allow that)."""
    _RELEASES[fixture_name] = stop


def used_later(session, fixture_name: str, after=None) -> bool:
    """Whether a collected test after ``after`` (or any, if None) uses ``fixture_name``."""
    items = session.items
    start = 0 if after is None else items.index(after) + 1
    return any(
        fixture_name in getattr(item, "fixturenames", ()) for item in items[start:]
    )


def release_finished(item) -> None:
    """Stop the resources ``item`` was the last collected test to use."""
    for name in list(_RELEASES):
        if name in getattr(item, "fixturenames", ()) and not used_later(
            item.session, name, after=item
        ):
            _RELEASES.pop(name)()
