"""Course machinery: code exercises and grading, reservations and lease timelines, slides, the notebook runner, node checks."""
from __future__ import annotations

from pathlib import Path


def source_tree() -> Path:
    """The folder holding the imported labkit package: in a checkout, the repository (notebooks/,
    requirements/ beside labkit/); in an installed wheel, site-packages (where neither exists)."""
    import labkit

    return Path(labkit.__file__).resolve().parents[1]
