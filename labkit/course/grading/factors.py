"""Which known factor a numeric answer is off by (issue #39): what students get wrong in this course.

`factor_hint(got, want)` is '' unless got / want is, within 0.1 %, one of the factors a calculation of
memory or communication goes wrong by: the number of ranks N or 1/N, (N-1)/N or N/(N-1) (the ring's share),
2 and 4 (bytes per bf16 / fp32 element; forward and backward; reduce-scatter and all-gather), 1e9 vs 2**30
(GB and GiB mixed), 8 (bits and bytes). Then it names the factor and where it comes from, e.g.
"your answer is exactly (N-1)/N = 3/4 of the right value (N = 4): ...". `answer_close` adds it to a failing
answer's message (labkit.course.grading.checks).
"""
from __future__ import annotations

import math

#: Rank counts the course's questions use (2- and 4-GPU nodes, 3-rank exercises, 8-GPU servers).
WORLD_SIZES = (2, 3, 4, 8)

_SCALES = (  # (factor, got is factor x want, got is want / factor, where the factor comes from)
    (2.0, "twice", "half", "a factor 2: bytes per bf16/fp16 element (2), forward and backward, or reduce-scatter and "
                   "all-gather counted twice or not at all"),
    (4.0, "4 times", "a quarter of", "a factor 4: bytes per fp32 element (4) used where another size belongs, or left out"),
    (2**30 / 1e9, "2**30 / 1e9 times", "1e9 / 2**30 of", "GB and GiB mixed: 1 GB = 1e9 B, 1 GiB = 2**30 B; keep one unit"),
    (8.0, "8 times", "an eighth of", "bits and bytes mixed: 1 B = 8 bits"),
)


def _close(ratio: float, factor: float, tol: float) -> bool:
    return abs(ratio / factor - 1) <= tol


def factor_hint(got: float, want: float, *, world_sizes: tuple[int, ...] = WORLD_SIZES, tol: float = 1e-3) -> str:
    """'' or "your answer is exactly <factor> the right value: <where that factor comes from>"."""
    if not (math.isfinite(got) and math.isfinite(want)) or want == 0 or got == 0:
        return ""
    ratio = got / want
    for n in world_sizes:  # the ring's share first: 3/4 is not a factor of 2 or 4
        for factor, words in (((n - 1) / n, f"(N-1)/N = {n - 1}/{n} of"), (n / (n - 1), f"N/(N-1) = {n}/{n - 1} x")):
            if n > 2 and _close(ratio, factor, tol):
                return (f"your answer is exactly {words} the right value (N = {n}): apply the ring's (N-1)/N -- each "
                        "rank sends and receives N-1 of the N chunks -- exactly once")
    for factor, times, part, why in _SCALES:
        if _close(ratio, factor, tol):
            return f"your answer is exactly {times} the right value: {why}"
        if _close(ratio, 1 / factor, tol):
            return f"your answer is exactly {part} the right value: {why}"
    for n in world_sizes:
        if n > 2 and _close(ratio, n, tol):
            return (f"your answer is exactly N = {n} times the right value: divide by the number of ranks once "
                    "(each holds 1/N of the sharded state)")
        if n > 2 and _close(ratio, 1 / n, tol):
            return (f"your answer is exactly 1/N = 1/{n} of the right value: what is replicated is not divided by "
                    "the number of ranks")
    return ""
