"""`labkit launch emit slurm|k8s`: the same `labkit train ...` on several nodes of a cluster.

Both emitters are pure functions returning text. Every node runs `labkit train <args> --nproc G --nnodes N
--node-rank R --rdzv-endpoint HEAD:PORT`; `labkit train` hands these to `labkit.runtime.launch.run`, which
starts torchrun with a rendezvous at the head node (node 0), so one command works on one laptop, one
node, or many nodes.
See docs/launching.md.
"""
from __future__ import annotations

import re
import shlex

import click

from labkit.errors import ConfigError

RDZV_PORT = 29500
_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


def _check(nodes: int, gpus_per_node: int, job_name: str, train_args: list[str]) -> list[str]:
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"nodes={nodes}, gpus_per_node={gpus_per_node}; both must be >= 1")
    if not _NAME.match(job_name):
        raise ConfigError(f"job name {job_name!r}: use lowercase letters, digits and '-' "
                          "(a Kubernetes name), e.g. 'labkit-ddp'")
    args = list(train_args)
    if args[:1] == ["train"]:  # `... -- train --strategy ddp` and `... -- --strategy ddp` mean the same
        args = args[1:]
    clash = sorted({"--nproc", "--nnodes", "--node-rank", "--rdzv-endpoint"} & {a.split("=")[0] for a in args})
    if clash:
        raise ConfigError(f"do not pass {', '.join(clash)} after '--': the emitted job sets them on every node "
                          "(ranks per node come from --gpus-per-node)")
    return args


def _node_command(train_args: list[str], nproc: int, node_rank: str, endpoint: str, nodes: str) -> str:
    """`labkit train ...` plus rank and rendezvous flags; the last three are shell expressions, quoted."""
    quoted = " ".join(shlex.quote(a) for a in ["labkit", "train", *train_args, "--nproc", str(nproc)])
    return f'{quoted} --nnodes "{nodes}" --node-rank "{node_rank}" --rdzv-endpoint "{endpoint}"'


def slurm_script(train_args: list[str], *, nodes: int, gpus_per_node: int, job_name: str = "labkit",
                 time: str = "01:00:00", port: int = RDZV_PORT) -> str:
    """An sbatch script running `labkit train ...` once per node (srun), torchrun rendezvous on node 0."""
    args = _check(nodes, gpus_per_node, job_name, train_args)
    if not _TIME.match(time):
        raise ConfigError(f"time={time!r}; use HH:MM:SS or D-HH:MM:SS, e.g. 02:00:00")
    # Single quotes: SLURM_NODEID must expand inside each srun task (one per node), not in the batch
    # script, where it is always 0. HEAD_NODE is exported by the batch script and inherited.
    per_node = _node_command(args, gpus_per_node, "$SLURM_NODEID", f"$HEAD_NODE:{port}", "$SLURM_NNODES")
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --time={time}",
        "#SBATCH --output=%x-%j.out",
        "# Submit from the repo with the labkit environment active: sbatch exports it to every node.",
        "set -euo pipefail",
        'export HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        f'echo "labkit: {nodes} node(s) x {gpus_per_node} GPU(s), rendezvous at $HEAD_NODE:{port}"',
        f"srun --nodes={nodes} --ntasks-per-node=1 bash -c {shlex.quote(per_node)}",
        "",
    ])


def k8s_manifest(train_args: list[str], *, nodes: int, gpus_per_node: int, job_name: str = "labkit",
                 image: str = "labkit:latest") -> str:
    """A Kubeflow PyTorchJob (Master + Worker replicas) running `labkit train ...` in every pod."""
    import yaml

    args = _check(nodes, gpus_per_node, job_name, train_args)
    # The training operator sets MASTER_ADDR/MASTER_PORT (the Master pod's service) and RANK (the pod's
    # index: Master 0, Worker i -> i+1) in every pod; bash expands them at start-up.
    per_node = _node_command(args, gpus_per_node, "$RANK", "$MASTER_ADDR:$MASTER_PORT", str(nodes))
    replicas = {"Master": 1, "Worker": nodes - 1}
    job = {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": job_name},
        "spec": {
            "nprocPerNode": str(gpus_per_node),
            "pytorchReplicaSpecs": {role: _replica(n, image, per_node, gpus_per_node)
                                    for role, n in replicas.items() if n > 0},
        },
    }
    return yaml.safe_dump(job, sort_keys=False)


def _replica(replicas: int, image: str, command: str, gpus: int) -> dict:
    container = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": image,
        "command": ["bash", "-c", command],
        "env": [{"name": "OMP_NUM_THREADS", "value": "1"}],
        "resources": {"limits": {"nvidia.com/gpu": gpus}},
        # NCCL and data loaders use /dev/shm; the container default (64 MB) is too small.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    return {"replicas": replicas, "restartPolicy": "Never",
            "template": {"spec": {"containers": [container],
                                  "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}}}


@click.group("launch")
def command() -> None:
    """Run labkit jobs on clusters (emit Slurm / Kubernetes job files)."""


@command.command("emit", context_settings={"ignore_unknown_options": True})
@click.argument("target", type=click.Choice(["slurm", "k8s"]))
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="Number of nodes.")
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=4, show_default=True,
              help="GPUs (ranks) per node.")
@click.option("--job-name", default="labkit", show_default=True, help="Slurm job / PyTorchJob name.")
@click.option("--time", "time_limit", default="01:00:00", show_default=True, help="Slurm time limit (slurm only).")
@click.option("--image", default="labkit:latest", show_default=True, help="Container image (k8s only).")
@click.option("--out", type=click.Path(dir_okay=False, writable=True), help="Write here instead of stdout.")
@click.argument("train_args", nargs=-1, type=click.UNPROCESSED)
def emit(target, nodes, gpus_per_node, job_name, time_limit, image, out, train_args) -> None:
    """Write a job file that runs `labkit train TRAIN_ARGS` on every node.

    Example: labkit launch emit slurm --nodes 2 --gpus-per-node 4 -- --strategy ddp --profile a100x4
    """
    if target == "slurm":
        text = slurm_script(list(train_args), nodes=nodes, gpus_per_node=gpus_per_node, job_name=job_name,
                            time=time_limit)
    else:
        text = k8s_manifest(list(train_args), nodes=nodes, gpus_per_node=gpus_per_node, job_name=job_name,
                            image=image)
    if out:
        with open(out, "w", encoding="utf-8") as fh:
            fh.write(text)
        click.echo(f"wrote {out}", err=True)
    else:
        click.echo(text, nl=False)
