"""Rehearsal: a GPU profile's notebook executed on a machine without GPUs, the week before class.

`LABKIT_REHEARSE=1` in a kernel (or `labkit notebooks run --profile a100x4 --rehearse`) changes only
the execution layer; the profile is the node's, unchanged (device "cuda", its GPUs, batch sizes,
precision), so notebook code takes every branch it takes on the node. Each run (`labkit.train.run`,
`run_many`, `library_parts` under `ex.spawn`) is:

1. **sized at its real size** (`labkit.train.stand_in.check_launch`): the estimator's bytes per GPU
   (`labkit.memory.runs`) against HEADROOM of the profile's GPU (or of its `memory_cap_gb`), and its
   ranks against the profile's GPUs. A run the node cannot hold raises what the node would: CUDA out
   of memory (`labkit.runtime.device.RehearsalOOM`, a `torch.OutOfMemoryError`, so a notebook's OOM lesson
   handles it as on the node) or, for more ranks than GPUs, `RehearsalError`; both in one line naming
   the run and the fix. Every run is logged (`record`, to the file `LABKIT_REHEARSE_LOG`): the notebook
   runner turns the log into the manifest `labkit.course.profile_check.lab_runs` reads, so no list of
   runs is kept by hand;
2. **executed as a stand-in** (`labkit.train.stand_in`): the same strategy, world size, options and
   precision (fp16 on V100 runs as fp16: CPU autocast and GradScaler support it), with a tiny model of
   the same family and layer structure (`llm_config`, `vision`: the same layer with its heads and
   experts, shrunk widths, at most MAX_LAYERS deep), short sequences / small images, the smallest batch
   that splits the same way and `STEPS` steps. Data and weights resolve as on the node (cached -> used,
   missing -> the node's own fallback or error). A multi-rank run executes rank 0's code (and the last
   rank's, for pipelines) in this process over torch's fake process group: no communication, real
   sizes, shapes, devices and code paths. `labkit.runtime.device` records every CUDA call instead of making it.

A lesson that runs out of memory on purpose (04's DDP run of Llama-2-7B, 06's full fine-tunes under
the 24 GB cap) says so with `with may_oom():` around the run; any other run that would not fit fails
the rehearsal even when the notebook handles the error. Records carry `rehearsal: True`, `show` marks
them and the course's grading refuses them: rehearsal numbers are not measurements. `expect(condition,
message)` is how a cell asserts on measured values: it raises normally and reports in a rehearsal.
This module imports nothing heavy (no torch): everything may ask `active()`.
Introduced in docs/gpu-node.md ("Rehearse the week before").
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Any


#: `1` in a process (a notebook kernel, a rank) that rehearses a GPU profile on CPU.
REHEARSE_ENV = "LABKIT_REHEARSE"
#: JSON-lines file every rehearsing process appends its recorded calls to (the notebook runner reads it).
LOG_ENV = "LABKIT_REHEARSE_LOG"
#: The profile the rehearsed notebook was given (its PROFILE parameter), when a runner set it.
PROFILE_ENV = "LABKIT_REHEARSE_PROFILE"

#: Optimizer steps a stand-in run trains (a traced run: enough for its trace window).
STEPS = 2
#: Tokens per sequence and image side of a stand-in run (context parallel needs seq % (2 x cp) == 0).
SEQ_LEN = 32
IMAGE_SIZE = 16
#: Attention head width of a stand-in LLM (hidden = heads x HEAD_DIM; rotary needs it even).
HEAD_DIM = 4
#: Decoder layers of a stand-in LLM: enough for an interleaved pipeline over 4 GPUs (2 chunks per stage);
#: a deeper stand-in only costs time (every layer is Python and dispatch overhead on a CPU).
MAX_LAYERS = 8
#: A stand-in ResNet's bottleneck width per group (torchvision's is 64): the 3x3 convolutions shrink 8x;
#: its blocks' outputs are 1x their planes, not 4x (the 1x1 convolutions shrink 4x).
RESNET_WIDTH = 8
#: Vocabulary of a stand-in for a preset (its text data is UTF-8 bytes); a checkpoint keeps its tokenizer's.
BYTE_VOCAB = 256
BANNER = ("REHEARSAL of profile {profile} on this machine's CPU: the node's code paths, devices and sizes, "
          "with stand-in models and {steps} steps per run. Numbers below are NOT measurements and are "
          "never graded.")
def active() -> bool:
    """True in a rehearsing process (LABKIT_REHEARSE=1). Cheap: no torch import."""
    return os.environ.get(REHEARSE_ENV) == "1"


def notebook_profile() -> str | None:
    """The rehearsed notebook's PROFILE (set by `labkit notebooks run --rehearse`), else None."""
    return os.environ.get(PROFILE_ENV) or None


def record(event: str, **detail: Any) -> None:
    """Log what the node would do (or what a run is): kept in `calls()` and appended as one JSON line to
    LABKIT_REHEARSE_LOG (every rehearsing process -- kernel, spawned ranks -- writes to the same file)."""
    entry = {"event": event, "pid": os.getpid(), "rank": int(os.environ.get("RANK", 0) or 0), **detail}
    _CALLS.append(entry)
    path = os.environ.get(LOG_ENV)
    if path:
        line = json.dumps(entry, default=str) + "\n"
        with open(path, "a", encoding="utf-8") as fh:  # one short write per line: O_APPEND keeps lines whole
            fh.write(line)


_CALLS: list[dict[str, Any]] = []


def calls(event: str | None = None) -> list[dict[str, Any]]:
    """What this process recorded (all, or one `event`)."""
    return [c for c in _CALLS if event is None or c["event"] == event]


def clear_calls() -> None:
    _CALLS.clear()


# ------------------------------------------------------------------------------------ sizing
_MAY_OOM: list[bool] = []


def oom_expected() -> bool:
    """True inside `may_oom()`: the run being sized is a lesson's deliberate out-of-memory run."""
    return bool(_MAY_OOM and _MAY_OOM[-1])


@contextlib.contextmanager
def may_oom(expected: bool = True):
    """Around a run a lesson lets run out of memory on the node (the notebook catches it): a rehearsal
    then raises the node's CUDA OOM without counting the run as a problem. Nothing outside a rehearsal."""
    _MAY_OOM.append(bool(expected))
    try:
        yield
    finally:
        _MAY_OOM.pop()


def compile_backend() -> str:
    """torch.compile's backend: TorchInductor; a rehearsal traces with dynamo but runs eager (Inductor's
    CPU code generation would take minutes and is not what the node compiles)."""
    return "eager" if active() else "inductor"


# ------------------------------------------------------------------------------------ stand-in models
def llm_config(config, *, keep_vocab: bool):
    """A tiny config of the same family and layer structure: the same decoder layer (attention and
    key/value heads, MLP, norms, experts: TP divisibility and expert placement hold as on the node) with
    widths shrunk to HEAD_DIM per head, at most MAX_LAYERS of them; the vocabulary shrinks to bytes
    unless a tokenizer's ids must fit."""
    heads = config.num_attention_heads
    changes = dict(hidden_size=heads * HEAD_DIM, intermediate_size=2 * heads * HEAD_DIM, head_dim=HEAD_DIM,
                   num_hidden_layers=min(config.num_hidden_layers, MAX_LAYERS))
    if not keep_vocab:
        changes["vocab_size"] = min(config.vocab_size, BYTE_VOCAB)
    if config.hidden_size <= changes["hidden_size"]:
        return config  # already tiny (tiny-llama, tiny-moe)
    small = config.__class__.from_dict({**config.to_dict(), **changes})
    return small


def vision(name: str, spec: dict):
    """A torchvision ResNet with the preset's blocks and classes and RESNET_WIDTH-wide bottlenecks."""
    from torchvision.models.resnet import Bottleneck, ResNet

    if name != "resnet50":
        return None  # tiny presets are their own stand-in

    class StandInBottleneck(Bottleneck):  # still a Bottleneck (checkpointing and wrapping find it); 1x, not 4x, wide out
        expansion = 1

    return ResNet(StandInBottleneck, list(spec["layers"]), num_classes=spec["num_classes"], width_per_group=RESNET_WIDTH)


# ------------------------------------------------------------------------------------ record keeping
def exec_count() -> int | None:
    """In[N] of the notebook cell running now (None outside IPython)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return None
    # `In` holds every input so far, this cell's last: its index is the cell's In[N]. The shell's
    # execution_count is not: this IPython has already counted the running cell (In[3] reads 4).
    inputs = getattr(shell, "user_ns", {}).get("In")
    if isinstance(inputs, list) and inputs:
        return len(inputs) - 1
    return getattr(shell, "execution_count", None)


def note_key(run_id: str, key: str) -> None:
    """The key a notebook showed a record under (`labkit.results.show`): the run's label in the manifest."""
    if active():
        record("key", run_id=run_id, key=key, exec_count=exec_count())


_BANNER_SHOWN: set = set()


def banner(profile) -> None:
    """Print the rehearsal banner once per GPU profile and process."""
    if profile.name not in _BANNER_SHOWN and profile.device == "cuda":
        _BANNER_SHOWN.add(profile.name)
        print(BANNER.format(profile=profile.name, steps=STEPS), flush=True)


def expect(condition: bool, message: str) -> bool:
    """Assert on measured values: AssertionError(message) when false -- but in a rehearsal, where numbers
    are not measurements, print what was not checked instead. Returns `condition`."""
    if condition:
        return True
    if active():
        print(f"rehearsal: not checked (numbers are not measurements): {message}")
        return False
    raise AssertionError(message)
