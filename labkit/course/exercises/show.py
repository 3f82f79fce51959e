"""`show_source(obj)`: print the source of the real transform a lab uses ("open the box", issue #15).

A notebook cell shows e.g. `apply_tensor` or torch's `ScheduleGPipe._step_microbatches` before the
student writes the same thing by hand, so the library call is no longer opaque. Introduced in
notebook 07_model_parallel.
"""
from __future__ import annotations

import inspect


def source_of(obj) -> str:
    """The source text of a function, method or class, headed by where it is defined."""
    try:
        text = inspect.getsource(obj)
        where = f"{inspect.getsourcefile(obj)}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError) as exc:
        raise TypeError(f"show_source({obj!r}): no Python source to show ({exc}); pass a function, "
                        "method or class defined in a .py file") from exc
    name = getattr(obj, "__qualname__", getattr(obj, "__name__", repr(obj)))
    return f"# {getattr(obj, '__module__', '?')}.{name}  ({where})\n{text}"


def show_source(obj) -> None:
    """Print `source_of(obj)` (in a notebook: the function the lab's registry call really runs)."""
    print(source_of(obj))
