"""Silence noise a student cannot act on (third-party imports, the course's test harness); keep every
labkit warning.

Installed by `import labkit` (so in every notebook) and by `labkit.runtime.rank_guard` in every rank, before
torch, transformers or peft are imported. Each entry names where the message comes from; a message
is dropped only if its logger/category AND its text match, so new or different warnings still show.
Introduced in notebook 00_setup.
"""
from __future__ import annotations

import logging
import re
import warnings

#: (logger name, message regex): records torch's logging prints at import of a third-party package.
LOG_NOISE = (
    # torchao (pulled in by transformers / peft) registers Enum subclasses with torch's pytree;
    # torch >= 2.13 logs a deprecation for each, twice per process. Not ours to fix.
    ("torch.utils._pytree", r"is an Enum subclass and is now natively supported by torch\.compile"),
)
#: (warning category, message regex, module regex) of Python warnings raised while importing.
WARNING_NOISE = (
    (DeprecationWarning, r".*register_constant\(\) on Enum subclasses is deprecated", r""),
    # The course's own exercise tests (`labkit.course.exercises.cases.load_module` names their module
    # labkit_exercise_tests_<file>; cloudpickle ships them to the ranks as "<dynamic-code>") compare
    # parameters with float(...): torch's advice to detach first is for the test's author, not the
    # student reading the output. Scoped to those modules: the same warning from student code shows.
    (UserWarning, r"Converting a tensor with requires_grad=True to a scalar", r"labkit_exercise_tests_"),
)


class _DropMatching(logging.Filter):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:  # a malformed record is not ours to judge: let it through
            return True
        return not self.pattern.search(text)


_installed = False


def install() -> None:
    """Add the filters once per process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, pattern in LOG_NOISE:
        logging.getLogger(name).addFilter(_DropMatching(pattern))
    filter_warnings()


def filter_warnings() -> None:
    """Add the WARNING_NOISE filters to the warnings filters in force (e.g. inside `catch_warnings`)."""
    for category, message, module in WARNING_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
