"""Rank programs for tests/test_rank_zygote.py, run as `python -m labkit.runtime.rank_guard _zygote_targets MODE [DIR]`.

No torch and no process group: what is checked is the process a rank is (warm or cold), not its work.
MODE: `describe` (prints one JSON line: what a rank sees of its process), `exit3`, `raise`, `killed` (SIGKILLs
itself), `wait` (writes DIR/<rank>.pid: its pid, parent, torchrun's and its parent, as JSON; calls rank_ready(), then waits; SIGTERM writes DIR/<rank>.term and exits 0).
"""
import json
import os
import signal
import sys
import time


def main(mode: str, folder: str | None = None) -> None:
    rank = os.environ.get("RANK", "0")
    if mode == "describe":
        print(json.dumps({"name": __name__, "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                          "env": dict(os.environ), "pid": os.getpid(), "ppid": os.getppid(),
                          "session_leader": os.getsid(0) == os.getpid(), "stdin_tty": os.isatty(0),
                          "stdout_write_through": sys.stdout.write_through}), flush=True)
    elif mode == "exit3":
        sys.exit(3)
    elif mode == "raise":
        raise ValueError("a rank exploded on purpose")
    elif mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "wait":
        def on_term(signum, frame):
            with open(os.path.join(folder, f"{rank}.term"), "w") as fh:
                fh.write("SIGTERM")
            sys.exit(0)

        signal.signal(signal.SIGTERM, on_term)
        torchrun = int(os.environ.get("LABKIT_TORCHRUN_PID", "0"))
        with open(os.path.join(folder, f".{rank}.pid"), "w") as fh:  # pid, parent, torchrun and its parent
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "torchrun": torchrun,
                       "torchrun_ppid": _ppid(torchrun) if torchrun else None}, fh)
        os.replace(os.path.join(folder, f".{rank}.pid"), os.path.join(folder, f"{rank}.pid"))
        from labkit.runtime.launch import rank_ready

        rank_ready()
        while True:
            time.sleep(3600)


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


if __name__ == "__main__":
    main(*sys.argv[1:])
