#!/usr/bin/env python3
"""`make gpu-check`: the acceptance check for the first GPU (labkit.course.gpu_check; docs/gpu-node.md).

    python scripts/gpu_check.py [--out build/gpu-check] [--budget 480] [--only g1,memory]

Runs from a checkout without installing labkit (a stock PyTorch CUDA image plus the wheels of
`make gpu-check-wheels`); writes OUT/report.json and OUT/report.md after every check, each check in its own
interpreter under its cap (CHECKS). Exit 1 if any check failed; skipped checks (no GPU here, a missing
wheel, a cap that no longer fits the budget) say why; `--only` reruns chosen checks, keeping the others' lines.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))

from labkit.course.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
