"""labkit.lease: the lease end from the environment, the harness deadline, the countdown."""
from __future__ import annotations

import datetime as dt
import sys
import threading

import pytest

from labkit import lease
from labkit.errors import ReservationError

END = "2025-02-14T16:55:00-05:00"
UTC = dt.timezone.utc


def test_lease_end_from_the_environment():
    assert lease.lease_end({lease.ENV_END: END}) == dt.datetime(2025, 2, 14, 21, 55, tzinfo=UTC)
    assert lease.lease_end({lease.ENV_END: "2025-02-14T21:55:00Z"}) == dt.datetime(2025, 2, 14, 21, 55, tzinfo=UTC)
    assert lease.lease_end({}) is None


@pytest.mark.parametrize("value", ["2025-02-14T16:55:00", "tomorrow", "16:55"])
def test_malformed_lease_end_is_a_clear_error(value):
    with pytest.raises(ReservationError, match=f"{lease.ENV_END}=.*UTC offset.*2025-02-14T16:55:00-05:00"):
        lease.lease_end({lease.ENV_END: value})


def test_a_named_lease_needs_python_chi(monkeypatch):
    monkeypatch.setitem(sys.modules, "chi", None)  # python-chi is not in the course venv
    with pytest.raises(ReservationError, match="pip install python-chi"):
        lease.lease_end({lease.ENV_LEASE: "labkit_ann"})


def test_default_deadline_keeps_a_margin_before_the_end():
    env = {lease.ENV_END: END}
    end = lease.lease_end(env)
    assert lease.default_deadline(environ=env) == end - dt.timedelta(minutes=10)
    assert lease.default_deadline(300, environ=env) == end - dt.timedelta(minutes=5)
    assert lease.default_deadline(dt.timedelta(minutes=20), environ=env) == end - dt.timedelta(minutes=20)
    assert lease.default_deadline(environ={}) is None
    assert lease.default_deadline_text(environ=env) == "2025-02-14T16:55:00-05:00"
    assert lease.default_deadline_text(environ={}) is None
    with pytest.raises(ReservationError, match="negative"):
        lease.default_deadline(-1, environ=env)


def test_remaining_and_describe():
    env = {lease.ENV_END: END}
    now = dt.datetime(2025, 2, 14, 20, 30, tzinfo=UTC)
    assert lease.remaining(now, env) == dt.timedelta(hours=1, minutes=25)
    assert "1 h 25 min left" in lease.describe(lease.lease_end(env), now)
    assert "ended" in lease.describe(lease.lease_end(env), now + dt.timedelta(hours=2))
    assert "no lease known" in lease.describe(None)


def test_countdown_is_plain_text_without_a_frontend(capsys):
    assert not lease._has_frontend()  # pytest (like papermill) has no Jupyter server frontend
    text = lease.countdown(environ={lease.ENV_END: END})
    assert text.startswith("lease ended") and text in capsys.readouterr().out


def test_countdown_widget_returns_at_once_and_refreshes_in_the_background():
    future = (dt.datetime.now(UTC) + dt.timedelta(hours=2)).isoformat()
    label = lease.countdown(widget=True, every_s=0.01, environ={lease.ENV_END: future})
    try:
        assert "1 h 5" in label.value and "left" in label.value
        workers = [t for t in threading.enumerate() if t.name == "labkit-lease-countdown"]
        assert workers and all(t.daemon for t in workers)
        label.value = ""
        for _ in range(500):  # the daemon thread writes the text back (every 0.01 s)
            if label.value:
                break
            threading.Event().wait(0.01)
        assert "left" in label.value
    finally:
        label._labkit_stop.set()
        label.close()


def test_train_takes_the_lease_end_as_its_default_deadline(monkeypatch):
    import datetime as dt

    from labkit.train.api import make_config

    end = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=2)).replace(microsecond=0)
    monkeypatch.setenv("LABKIT_LEASE_END", end.isoformat())
    assert make_config("single", "tiny-llama", steps=2).checkpoint.deadline == end.isoformat()
    given = (end - dt.timedelta(hours=1)).isoformat()
    assert make_config("single", "tiny-llama", steps=2, deadline=given).checkpoint.deadline == given
    monkeypatch.delenv("LABKIT_LEASE_END")
    assert make_config("single", "tiny-llama", steps=2).checkpoint.deadline is None
