"""The labkit error hierarchy. Every error says what was wrong and how to fix it (STYLE.md #10)."""


class LabkitError(Exception):
    """Base class: a user-facing error whose message names the bad value and the fix."""


class ConfigError(LabkitError, ValueError):
    """A profile, config field, model or strategy name is unknown or has a bad value."""


class LaunchError(LabkitError, RuntimeError):
    """A multi-process run failed: carries the failing rank and its traceback."""

    def __init__(self, message: str, *, rank: int | None = None, traceback: str = "", output: str = ""):
        super().__init__(message)
        self.rank = rank
        self.traceback = traceback
        self.output = output


class HardwareError(ConfigError):
    """This machine lacks what the chosen profile needs (GPUs, memory, bf16). One line, in a notebook too."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the traceback: the notebook shows the one-line fix.
        return [f"HardwareError: {self}"]


class NeedsMoreGPUs(HardwareError):
    """A lab needs more GPUs than the profile has (Colab's one T4 for a 2-GPU lab): the notebook stops
    at its first cell with where to run it instead; `labkit notebooks run` counts it as stopped, not failed."""

    def _render_traceback_(self) -> list[str]:
        return [f"NeedsMoreGPUs: {self}"]


class RehearsalError(LabkitError, RuntimeError):
    """A rehearsal (a GPU profile's notebook run on CPU, labkit.runtime.rehearsal) found what would fail on the node."""

    def _render_traceback_(self) -> list[str]:
        return [f"{type(self).__name__}: {self}"]


class NotebookError(LabkitError, RuntimeError):
    """A notebook failed to execute or breaks the hygiene rules."""


class GradingError(LabkitError):
    """A submission cannot be graded (invalid, tampered, missing results)."""


class ReservationError(LabkitError):
    """A lease or policy file is invalid."""


def choices_error(kind: str, value: object, valid) -> ConfigError:
    """`ConfigError` for a name that is not one of `valid`, listing the valid ones."""
    names = ", ".join(sorted(valid))
    plural = kind[:-1] + "ies" if kind.endswith("y") and kind[-2:-1] not in "aeiou" else kind + "s"
    return ConfigError(f"unknown {kind} {value!r}; valid {plural} are: {names}")
