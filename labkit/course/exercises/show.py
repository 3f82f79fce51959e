"""`show_source(obj)`: "open the box" -- the real source of a labkit function or class, highlighted.

Used by the labs' exercise sections (issue #15) right before the student writes the same lines.
"""
from __future__ import annotations

import inspect


def show_source(obj) -> None:
    """Display `obj`'s source as highlighted Python in Jupyter (plain text elsewhere), with where it lives."""
    lines, start = inspect.getsourcelines(obj)
    where = f"# {obj.__module__}.{obj.__qualname__}  ({inspect.getsourcefile(obj)}:{start})\n"
    text = where + "".join(lines)
    try:
        from IPython import get_ipython
        from IPython.display import Code, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        display(Code(text, language="python"))
    else:
        print(text)
