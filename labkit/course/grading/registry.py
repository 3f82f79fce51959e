"""Which checks grade which course notebook.

Course notebooks declare theirs in `labkit/course/grading/nb_checks/lab<NOTEBOOK>.py` (module-level
`NOTEBOOK = "01_memory"` and `CHECKS = (...)`); `register()` adds or replaces a notebook's checks at run
time (tests, or an instructor's private hidden checks loaded with `load_file`).
"""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from pathlib import Path
from typing import Iterable

from labkit.errors import ConfigError, GradingError
from labkit.course.grading.checks import Check

_PACKAGE = "labkit.course.grading.nb_checks"
_REGISTERED: dict[str, tuple[Check, ...]] = {}


def _validate(notebook: str, checks: Iterable[Check]) -> tuple[Check, ...]:
    checks = tuple(checks)
    if not notebook or not isinstance(notebook, str):
        raise ConfigError(f"notebook name {notebook!r}; give the course notebook's name, e.g. '01_memory'")
    seen = set()
    for check in checks:
        if not isinstance(check, Check):
            raise ConfigError(f"{notebook}: {check!r} is not a labkit.course.grading.checks.Check")
        if check.name in seen:
            raise ConfigError(f"{notebook}: two checks are named {check.name!r}; give each a unique name")
        seen.add(check.name)
    return checks


def register(notebook: str, checks: Iterable[Check]) -> None:
    """Declare (or replace) the checks of `notebook` for this process."""
    _REGISTERED[notebook] = _validate(notebook, checks)


def unregister(notebook: str) -> None:
    _REGISTERED.pop(notebook, None)


def _module_name(notebook: str) -> str:
    return f"{_PACKAGE}.lab{notebook}"


def declared() -> list[str]:
    """Notebooks with checks: registered ones and those with a module in nb_checks."""
    package = importlib.import_module(_PACKAGE)
    names = {m.name[3:] for m in pkgutil.iter_modules(package.__path__) if m.name.startswith("lab")}
    return sorted(names | set(_REGISTERED))


def checks_for(notebook: str) -> tuple[Check, ...]:
    """The checks of `notebook`; GradingError naming the known notebooks when it has none."""
    if notebook in _REGISTERED:
        return _REGISTERED[notebook]
    if f"lab{notebook}".isidentifier():
        if importlib.util.find_spec(_module_name(notebook)) is not None:
            module = importlib.import_module(_module_name(notebook))
            return _validate(notebook, getattr(module, "CHECKS", ()))
    raise GradingError(f"no checks are declared for notebook {notebook!r}; known notebooks: "
                       f"{', '.join(declared()) or '(none)'}")


def load_file(path: str | Path) -> list[str]:
    """Register the checks of a Python file defining `CHECKS = {"01_memory": [Check, ...], ...}`."""
    path = Path(path)
    spec = importlib.util.spec_from_file_location(f"labkit_private_checks_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ConfigError(f"cannot load checks from {path}; give a .py file defining CHECKS")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = getattr(module, "CHECKS", None)
    if not isinstance(table, dict):
        raise ConfigError(f"{path} must define CHECKS = {{'<notebook>': [Check, ...]}}")
    for notebook, checks in table.items():
        base = checks_for(notebook) if notebook in declared() else ()
        register(notebook, tuple(base) + tuple(checks))
    return sorted(table)
