"""Lease awareness: when does this node go away, and how long is left?

A Chameleon lease that ends takes the server and every unsaved file with it. The end comes from,
in order: the environment variable `LABKIT_LEASE_END` (ISO 8601 with a UTC offset; the
reservation notebook writes it into the node's ~/.profile), python-chi when `LABKIT_LEASE` names
the lease (id or name), or nothing (a laptop: no deadline). `labkit train` takes
`default_deadline()` as its `--deadline` so a checkpoint is written before the node disappears.
Introduced in `reservations/README.md` ("What to do in a block") and notebook 00_setup.
"""
from __future__ import annotations

import datetime as dt
import os
import threading
from typing import Mapping

from labkit.errors import ReservationError

ENV_END = "LABKIT_LEASE_END"
ENV_LEASE = "LABKIT_LEASE"
DEFAULT_MARGIN = dt.timedelta(minutes=10)


def lease_end(environ: Mapping[str, str] | None = None) -> dt.datetime | None:
    """The current lease's end (aware), or None when no lease is known."""
    environ = os.environ if environ is None else environ
    text = environ.get(ENV_END, "").strip()
    if text:
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            when = None
        if when is None or when.tzinfo is None:
            raise ReservationError(f"{ENV_END}={text!r} is not an ISO 8601 time with a UTC offset; "
                                   f"set it like {ENV_END}=2025-02-14T16:55:00-05:00 (or ...T21:55:00Z), "
                                   f"or unset it")
        return when
    ref = environ.get(ENV_LEASE, "").strip()
    if ref:
        return chi_lease_end(ref)  # python-chi only when asked for: it needs credentials
    return None


def require_chi():
    """The `chi` module, or a `ReservationError` that says how to get it."""
    try:
        import chi  # noqa: F401
        import chi.lease  # noqa: F401
        import chi.server  # noqa: F401
    except ImportError as exc:
        raise ReservationError(
            "python-chi is not installed, and talking to Chameleon needs it: `pip install python-chi` "
            "(it is preinstalled on Chameleon's Jupyter, jupyter.chameleoncloud.org); for a check "
            "without credentials use `labkit reserve check LEASES.csv` or `create --dry-run`") from exc
    return chi


def _aware_utc(value) -> dt.datetime:
    when = value if isinstance(value, dt.datetime) else dt.datetime.fromisoformat(str(value))
    return when.replace(tzinfo=dt.timezone.utc) if when.tzinfo is None else when


def chi_lease_end(ref: str) -> dt.datetime:
    """End of the lease named or id'd `ref`, aware (Blazar reports naive UTC)."""
    lease = require_chi().lease.get_lease(ref)
    value = lease["end_date"] if isinstance(lease, dict) else lease.end_date
    return _aware_utc(value)


def remaining(now: dt.datetime | None = None, environ: Mapping[str, str] | None = None) -> dt.timedelta | None:
    """Time left in the lease (negative once it has ended), or None when no lease is known."""
    end = lease_end(environ)
    if end is None:
        return None
    return end - (now or dt.datetime.now(dt.timezone.utc))


def default_deadline(margin: dt.timedelta | float = DEFAULT_MARGIN,
                     environ: Mapping[str, str] | None = None) -> dt.datetime | None:
    """When training should stop and checkpoint: the lease end minus `margin` (a timedelta or
    seconds), or None with no known lease. Ten minutes covers saving a 7B checkpoint to local disk."""
    if not isinstance(margin, dt.timedelta):
        margin = dt.timedelta(seconds=float(margin))
    if margin < dt.timedelta(0):
        raise ReservationError(f"margin={margin} is negative; give the time to keep free before the "
                               f"lease ends, e.g. timedelta(minutes=10)")
    end = lease_end(environ)
    return None if end is None else end - margin


def default_deadline_text(margin: dt.timedelta | float = 0.0,
                          environ: Mapping[str, str] | None = None) -> str | None:
    """`default_deadline` as the ISO text `labkit train --deadline` takes (the harness keeps its own
    save margin, hence 0 here), or None with no known lease."""
    when = default_deadline(margin, environ)
    return None if when is None else when.isoformat()


def describe(end: dt.datetime | None, now: dt.datetime | None = None) -> str:
    """One line for humans: when the lease ends and how long is left."""
    if end is None:
        return (f"no lease known (set {ENV_END}=<ISO time with offset> or {ENV_LEASE}=<lease name>); "
                f"no deadline")
    left = end - (now or dt.datetime.now(dt.timezone.utc))
    when = f"{end.astimezone(dt.timezone.utc):%a %Y-%m-%d %H:%M} UTC ({end.astimezone():%H:%M} local)"
    if left <= dt.timedelta(0):
        return f"lease ended {when}: the node may be reclaimed at any moment"
    minutes = int(left.total_seconds() // 60)
    return (f"lease ends {when}: {minutes // 60} h {minutes % 60:02d} min left - save notebooks and "
            f"checkpoints before then")


def _has_frontend() -> bool:
    """True inside a Jupyter kernel started by a Jupyter server (a browser can render widgets);
    papermill / nbclient kernels have no JPY_SESSION_NAME, so they get plain text."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and hasattr(shell, "kernel") and bool(os.environ.get("JPY_SESSION_NAME"))


def countdown(*, widget: bool | None = None, every_s: float = 30.0,
              environ: Mapping[str, str] | None = None):
    """Show the time left. With a notebook frontend: an ipywidgets Label refreshed every `every_s`
    by a daemon thread (the cell returns at once); otherwise (papermill, terminal): one text line.
    Returns the Label or the text."""
    end = lease_end(environ)
    text = describe(end)
    if not (_has_frontend() if widget is None else widget):
        print(text)
        return text
    import ipywidgets
    from IPython.display import display

    label = ipywidgets.Label(value=text)
    display(label)
    if end is not None:
        stop = threading.Event()

        def tick():
            while not stop.wait(every_s) and label.comm is not None:
                label.value = describe(end)
                if end <= dt.datetime.now(dt.timezone.utc):
                    return

        threading.Thread(target=tick, name="labkit-lease-countdown", daemon=True).start()
        label._labkit_stop = stop  # lets a caller stop the refresh: label._labkit_stop.set()
    return label
