"""`show_source(obj)`: "open the box" -- print the real source of the transform a lab uses (issue #15).

A lab's exercise section shows e.g. `apply_fsdp`, `apply_tensor` or torch's
`ScheduleGPipe._step_microbatches` right before the student writes the same lines by hand, so the
library call is no longer opaque. Highlighted in Jupyter, plain text elsewhere.
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
    """Display `source_of(obj)`: highlighted Python in a Jupyter kernel, printed text elsewhere."""
    text = source_of(obj)
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Code(text, language="python"))
    else:
        print(text)
