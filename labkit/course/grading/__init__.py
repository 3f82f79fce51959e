"""Grading executed notebooks on their recorded (GPU) results: checks, seals, sandbox, batch.

`labkit check NOTEBOOK.ipynb` (students) and `labkit grade SUBMISSIONS_DIR --out OUT_DIR` (instructors)
are the entry points; docs/grading.md explains the design and its limits. Importing this package
registers the seal as a `labkit.results` publisher (`labkit/__init__.py` registers it lazily too), and
`show/answer` may import it for that, so this file stays free of heavy imports.
"""
from labkit import results as _results
from labkit.course.grading.fingerprint import seal as _seal

_results.register_publisher("seal", _seal)
