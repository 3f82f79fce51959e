"""torchrun's rank logs, read while a job runs and after it failed (`labkit.runtime.launch` and
`labkit.runtime.rank_pool` start the jobs).

torchrun's `--log-dir` + `--redirects 3` writes `<log_dir>/<run_id>_*/attempt_0/<local_rank>/`
`{stdout.log, stderr.log, error.json}`; `error.json` exists when the entry point is decorated with
`torch.distributed.elastic.multiprocessing.errors.record` (the official route, see
https://docs.pytorch.org/docs/stable/elastic/errors.html); otherwise the traceback is read from the
rank's stderr log. While the job runs, `_RankTail` follows local rank 0's logs and echoes them live
(`_Reader` drains torchrun's own output); when it fails, `_failure` names the rank that failed first
and carries its traceback, `timeout_error` says what to do about a run that ran out of time.
Introduced in notebook 03_ddp.
"""
from __future__ import annotations

import codecs
import glob
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

from labkit.errors import LaunchError

#: Seconds between looks at a rank's log folder and files.
_POLL_S = 0.1


# ---------------------------------------------------------------- live output
class _Reader(threading.Thread):
    """Drains a pipe (torchrun's own stdout+stderr) into memory so torchrun never blocks on it."""

    def __init__(self, pipe):
        super().__init__(daemon=True)
        self.pipe, self.chunks = pipe, []

    def run(self) -> None:
        for chunk in iter(lambda: self.pipe.read1(65536), b""):
            self.chunks.append(chunk)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode("utf-8", "replace")


class _RankTail(threading.Thread):
    """Follows one rank's stdout.log/stderr.log as torchrun writes them; echoes raw chunks live.

    Raw bytes (not lines) are forwarded, so tqdm's carriage-return redraws work in a terminal and
    in a Jupyter cell. sys.stdout is looked up at write time: in a notebook it is the cell's stream.
    """

    def __init__(self, pattern: str, echo: bool, offsets: dict[str, int] | None = None):
        super().__init__(daemon=True)
        self.pattern, self.echo = pattern, echo
        self.offsets = offsets or {}  # bytes of each stream to skip: a warm rank's earlier runs (labkit.runtime.rank_pool)
        self.done = threading.Event()
        self.parts: list[str] = []

    def run(self) -> None:
        folder = self._wait_for_folder()
        if folder is None:
            return
        streams = [(folder / "stdout.log", "stdout"), (folder / "stderr.log", "stderr")]
        handles: dict[str, object] = {}
        decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for _, name in streams}
        try:
            while True:
                finished = self.done.is_set()  # read once more after the run ended, then stop
                got = sum(self._pump(path, name, handles, decoders[name]) for path, name in streams)
                if finished and not got:
                    return
                if not got:
                    time.sleep(_POLL_S)
        finally:
            for fh in handles.values():
                fh.close()

    def _wait_for_folder(self) -> Path | None:
        while True:
            found = glob.glob(self.pattern)
            if found:
                return Path(found[0])
            if self.done.is_set():
                return None
            time.sleep(_POLL_S)

    def _pump(self, path: Path, name: str, handles: dict, decoder) -> int:
        if name not in handles:
            if not path.exists():
                return 0
            handles[name] = path.open("rb")
            handles[name].seek(self.offsets.get(name, 0))
        data = handles[name].read(65536)
        if data:
            text = decoder.decode(data)
            self.parts.append(text)
            if self.echo:
                stream = getattr(sys, name)
                stream.write(text)
                stream.flush()
        return len(data)

    @property
    def text(self) -> str:
        return "".join(self.parts)


# ---------------------------------------------------------------- a run that stopped
def timeout_error(module: str, timeout_s: float, nproc: int, logs: str, output: str) -> LaunchError:
    return LaunchError(f"{module} did not finish within timeout_s={timeout_s:g} s on {nproc} rank(s); all ranks "
                       f"were stopped. Raise timeout_s (or the profile's timeout_s) if the run needs longer, "
                       f"or look for a rank stuck in a collective in the logs under {logs}", output=output)


def _attempt_dir(root: str, run_id: str) -> str | None:
    found = sorted(glob.glob(os.path.join(glob.escape(root), f"{run_id}_*", "attempt_*")))
    return found[-1] if found else None


# ---------------------------------------------------------------- failure reports
_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)", re.S)
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ?", re.M)  # torch prefixes uncaught-exception lines


def _failure(module: str, code: int, attempt: str | None, launcher: str, output: str, *,
             nproc: int, node_rank: int) -> LaunchError:
    """A LaunchError for the rank that failed first, with that rank's traceback."""
    rank, local = _root_cause(launcher, attempt, nproc, node_rank)
    trace = _rank_traceback(attempt, local) if local is not None else ""
    if rank is None:
        tail = "\n".join(launcher.strip().splitlines()[-20:])
        return LaunchError(f"{module} failed before any rank reported an error (torchrun exit code {code}):\n{tail}",
                           traceback=trace, output=output)
    last = trace.strip().splitlines()[-1] if trace.strip() else f"exit code {code}, no traceback in its logs"
    where = os.path.join(attempt, str(local)) if attempt else "(no log folder)"
    message = f"{module} failed on rank {rank}: {last}\nrank {rank} logs: {where}"
    if trace:
        label = "traceback" if trace.startswith("Traceback") else "stderr (last lines)"
        message += f"\n--- rank {rank} {label} ---\n{trace.rstrip()}"
    return LaunchError(message, rank=rank, traceback=trace, output=output)


def _root_cause(launcher: str, attempt: str | None, nproc: int, node_rank: int) -> tuple[int | None, int | None]:
    """(global rank, local rank) of the first failure: torchrun's 'Root Cause' summary, else the logs."""
    match = _ROOT_CAUSE.search(launcher)
    if match:
        return int(match.group(1)), int(match.group(2))
    # No summary (e.g. torchrun itself was killed): the rank whose error was written first.
    candidates = []
    for local in range(nproc):
        folder = Path(attempt or "/nonexistent") / str(local)
        for name in ("error.json", "stderr.log"):
            path = folder / name
            if path.exists() and (name == "error.json" or "Traceback" in path.read_text(errors="replace")):
                candidates.append((path.stat().st_mtime_ns, local))
                break
    if not candidates:
        return None, None
    local = min(candidates)[1]
    return node_rank * nproc + local, local


def _rank_traceback(attempt: str | None, local: int) -> str:
    """The rank's Python traceback: error.json's py_callstack if @record wrote one, else its stderr log."""
    if attempt is None:
        return ""
    folder = Path(attempt) / str(local)
    error_file = folder / "error.json"
    if error_file.exists():
        try:
            message = json.loads(error_file.read_text())["message"]
            if isinstance(message, dict) and message.get("extraInfo", {}).get("py_callstack"):
                return message["extraInfo"]["py_callstack"]
        except (ValueError, KeyError, TypeError):
            pass  # a half-written or foreign error file: fall back to the stderr log
    stderr = folder / "stderr.log"
    if not stderr.exists():
        return ""
    text = _RANK_PREFIX.sub("", stderr.read_text(errors="replace"))
    start = text.find("Traceback (most recent call last)")
    return text[start:] if start >= 0 else "\n".join(text.rstrip().splitlines()[-30:])
