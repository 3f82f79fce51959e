"""Plan a GPU lease so that nothing is lost when it ends.

The course lends one 3-hour block on a 4x A100 80GB node, or two 2-hour blocks (one on a 1x A100
80GB node for the single-GPU labs, one on a 4x node for the multi-GPU labs). A lease is deleted at
its end together with everything on the node, so the plan orders the labs, gives each a time
budget, and ends with a save step and a copy-off step that finishes at least `MARGIN_MIN` minutes
before the lease ends. The course asks leases to end 5 minutes before the hour (XX:00 -> YY:55),
which `END_EARLY_MIN` subtracts. Pure Python, no torch. Introduced in notebook 00_setup.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from labkit.errors import ConfigError, choices_error
from labkit.profiles import Profile, get_profile

#: the course asks for leases that end 5 minutes before the hour boundary (start XX:00, end YY:55).
END_EARLY_MIN = 5
#: results must be off the node this many minutes before the lease ends (it may be cut early).
MARGIN_MIN = 10
#: a bare-metal node boots after the lease starts (~10 min on Chameleon): the lease clock is running.
LAUNCH_MIN = 10
SETUP_MIN = 15
#: `labkit fetch` of the profile's weights and data (TinyLlama ~2.2 GB, Food-11 ~1.1 GB): a few minutes
#: on the site's network, budgeted generously. Done right after setup, before the first lab needs them.
DOWNLOAD_MIN = 10
SAVE_MIN = 5
COPY_MIN = 5


class LeaseStep(NamedTuple):
    """One step of a lease plan; minutes are counted from the start of the lease."""

    start_min: int
    end_min: int
    what: str
    why: str


@dataclass(frozen=True)
class Lab:
    """One lab's place in a lease."""

    key: str
    """Short id, e.g. '03_ddp'."""
    title: str
    """What the step shows in the plan."""
    minutes: int
    """Time budget on an A100 node, setup excluded."""
    min_gpus: int
    """Fewest GPUs the lab needs (2+ for anything distributed)."""
    why: str
    """Why it sits where it does."""


#: The labs in the order they build on each other: each later lab is compared with the earlier ones.
LABS: tuple[Lab, ...] = (
    Lab("02_single", "02 single GPU: ResNet-50 baseline", 15, 1,
        "the baseline every later lab is compared with, so it runs first"),
    Lab("03_ddp", "03 DDP: data parallel on all GPUs", 15, 2,
        "compares throughput with 02; needs more than one GPU"),
    Lab("04_fsdp", "04 FSDP: sharded data parallel", 15, 2,
        "per-GPU memory against DDP (03); sharding needs several GPUs"),
    Lab("05_zero", "05 DeepSpeed ZeRO stages 1-3 (+ offload)", 20, 2,
        "same questions as 04 with DeepSpeed; the first run JIT-builds ops (a few minutes)"),
    Lab("06_peft", "06 LoRA / QLoRA fine-tuning", 20, 1,
        "one GPU is enough: adapters and 4-bit weights are how a big model fits on one card"),
    Lab("07_model_parallel", "07 pipeline and tensor parallel", 15, 2,
        "splits one model over GPUs; needs the 4x node"),
    Lab("08_profiling", "08 profiling: compute vs communication", 10, 2,
        "profiles the distributed runs above"),
    Lab("09_beyond_3d", "09 beyond 3-D: bandwidth, schedules, context and expert parallel", 10, 2,
        "measures the node's links and builds on 07's pipelines; on a one-GPU node it runs on CPU ranks"),
)
_BY_KEY = {lab.key: lab for lab in LABS}


def _gpu_profile(profile: str | Profile) -> Profile:
    prof = get_profile(profile)
    if prof.device != "cuda":
        raise ConfigError(f"profile {prof.name!r} runs on {prof.device}; a lease plan is for a GPU node: "
                          "use 'a100x4', 'a100x1' or 'v100x4'")
    return prof


def _labs_for(profile: Profile, labs: Sequence[str] | None) -> list[Lab]:
    if labs is None:
        return [lab for lab in LABS if lab.min_gpus <= profile.nproc]
    chosen = []
    for key in labs:
        if key not in _BY_KEY:
            raise choices_error("lab", key, _BY_KEY)
        lab = _BY_KEY[key]
        if lab.min_gpus > profile.nproc:
            raise ConfigError(f"lab {key!r} needs {lab.min_gpus}+ GPUs but profile {profile.name!r} has "
                              f"{profile.nproc}; plan it on the 4x node ('a100x4')")
        chosen.append(lab)
    return sorted(chosen, key=LABS.index)


def plan_lease(hours: float = 3.0, profile: str | Profile = "a100x4", *,
               labs: Sequence[str] | None = None) -> list[LeaseStep]:
    """Ordered steps for one lease of `hours` on the node of `profile`.

    `labs` defaults to every lab the node has enough GPUs for. Raises ConfigError when the labs do
    not fit before the copy-off deadline (then use `plan_two_blocks()` or fewer labs).
    """
    prof = _gpu_profile(profile)
    if not hours > 0:
        raise ConfigError(f"hours={hours!r}; a lease lasts a positive number of hours, e.g. 3.0")
    chosen = _labs_for(prof, labs)
    lease_min = int(round(hours * 60)) - END_EARLY_MIN
    deadline = lease_min - MARGIN_MIN  # the copy-off must be done by then
    needed = _needed(chosen)
    if needed > deadline:
        raise ConfigError(f"{len(chosen)} labs need {needed} min but a {hours:g}-hour lease on {prof.name!r} "
                          f"leaves {deadline} min before results must be copied off; pass fewer `labs` "
                          "or split the work over two blocks with plan_two_blocks()")
    steps: list[LeaseStep] = []

    def add(minutes: int, what: str, why: str) -> None:
        start = steps[-1].end_min if steps else 0
        steps.append(LeaseStep(start, start + minutes, what, why))

    add(LAUNCH_MIN, "launch: the node boots (bare metal, ~10 min); start JupyterLab once it is up",
        "the lease clock runs from the reservation's start, not from when the node answers ssh")
    add(SETUP_MIN, f"setup: clone, `conda env create -f environment.yml`, run 00_setup with PROFILE={prof.name!r}",
        f"`labkit env` must show {prof.nproc} GPU(s) before any lab; a broken environment found later costs "
        "a lab. Every lab appends its results to runs/ as it goes")
    add(DOWNLOAD_MIN, f"download: `labkit fetch --status --profile {prof.name}`, then `labkit fetch` what is missing",
        "pretrained weights and Food-11 come from the network once; a lab that downloads mid-run loses its slot")
    for lab in chosen:
        add(lab.minutes, lab.title, lab.why)
    if deadline - needed > 0:
        add(deadline - needed, "buffer: re-run a failed lab, finish the answers",
            "slack for a lab that overruns; it sits before saving so the save still happens")
    add(SAVE_MIN, "save: let running jobs checkpoint (`labkit train --deadline`), `labkit check`, "
        "commit answers", "a job still running at the end would lose its results")
    add(COPY_MIN, "copy off: `rsync -av cc@NODE_IP:labkit/notebooks/ labkit-notebooks/` from your laptop (your "
        "notebooks and runs/ beside them; also $LABKIT_RUNS if you set one)",
        "everything on the node is deleted with the lease")
    add(MARGIN_MIN, "margin: nothing left on the node that you need",
        f"the copy is done {MARGIN_MIN}+ min before the end, in case the lease ends early")
    return steps


def _needed(labs: Sequence[Lab]) -> int:
    """Minutes from the lease start to the end of the copy-off for `labs`."""
    return LAUNCH_MIN + SETUP_MIN + DOWNLOAD_MIN + sum(lab.minutes for lab in labs) + SAVE_MIN + COPY_MIN


def plan_two_blocks(hours: float = 2.0) -> dict[str, list[LeaseStep]]:
    """The two-block alternative: single-GPU labs on a 1x A100, the rest on a 4x node.

    With the node's launch and the downloads counted, the multi-GPU labs may not all fit in one
    block: those that do not go to one more block in the overnight hours (1AM-7AM), which the course's
    rules allow for extra time. Labs keep their order; the plan never squeezes the save margin."""
    single = [lab.key for lab in LABS if lab.min_gpus == 1]
    multi = [lab for lab in LABS if lab.min_gpus > 1]
    deadline = int(round(hours * 60)) - END_EARLY_MIN - MARGIN_MIN
    fits = [lab.key for i, lab in enumerate(multi) if _needed(multi[:i + 1]) <= deadline]
    rest = [lab.key for lab in multi if lab.key not in fits]
    blocks = {
        "1x A100 80GB (gigaio-compute-*), profile a100x1": plan_lease(hours, "a100x1", labs=single),
        "4x A100 (JOBG3Q3) or 4x V100 (P3-GPU-*), profile a100x4 / v100x4": plan_lease(hours, "a100x4", labs=fits),
    }
    if rest:
        blocks["one more 4x block in the overnight hours (1AM-7AM), profile a100x4 / v100x4"] = plan_lease(
            hours, "a100x4", labs=rest)
    return blocks


def _clock(start: str | None, minute: int) -> str:
    if start is None:
        return f"{minute // 60}:{minute % 60:02d}"
    try:
        hh, mm = (int(part) for part in start.split(":"))
    except ValueError:
        raise ConfigError(f"start={start!r}; give the lease start as HH:MM, e.g. '14:00'") from None
    total = hh * 60 + mm + minute
    return f"{total // 60 % 24:02d}:{total % 60:02d}"


def format_plan(steps: Sequence[LeaseStep], *, start: str | None = None) -> str:
    """Fixed-width text table; times are offsets (h:mm) or clock times from `start` ('HH:MM')."""
    rows = [(f"{_clock(start, s.start_min)}-{_clock(start, s.end_min)}", s.what, s.why) for s in steps]
    width = max(len(r[0]) for r in rows)
    what_w = max(len(r[1]) for r in rows)
    return "\n".join(f"{t.ljust(width)}  {w.ljust(what_w)}  {y}" for t, w, y in rows)
