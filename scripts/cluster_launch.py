"""`accelerate launch` on one node of a Kubeflow PyTorchJob or a SkyPilot task: the cluster's variables become
the launch's machine count, machine rank, main address and port, and process count.

    python scripts/cluster_launch.py --config_file accelerate_configs/multi_node.yaml train.py --max_steps 1000

The arguments are `accelerate launch`'s (scripts/launch.py checks the config file first); this script adds
`--num_machines --machine_rank --main_process_ip --main_process_port --num_processes` (machines x processes per
node) from the environment, which deploy/kubernetes/pytorchjob.yaml and deploy/skypilot/train.yaml run in every
pod or node. The address is always passed: without it `accelerate launch --multi_gpu` in PyTorchJob pods sets
MASTER_ADDR to 127.0.0.1, where the pods cannot reach each other (accelerate issue #3414).

Kubeflow Training Operator (PyTorchJob; Trainer v2's TrainJob sets the same PET_ variables):
    PET_NNODES (pods), PET_NPROC_PER_NODE (processes per pod), PET_NODE_RANK (RANK in older operators),
    PET_MASTER_ADDR and PET_MASTER_PORT (MASTER_ADDR and MASTER_PORT in older operators).
    The operator's WORLD_SIZE is not read: it is the process count in newer operators and the pod count in older
    ones. Its RANK is the pod's index, not a process's; torchrun gives every process its own RANK and WORLD_SIZE.
SkyPilot:
    SKYPILOT_NUM_NODES, SKYPILOT_NODE_RANK, SKYPILOT_NODE_IPS (one address a line, the head node first),
    SKYPILOT_NUM_GPUS_PER_NODE (0 on a CPU node: one process); the port is MAIN_PROCESS_PORT (default 29500).

Missing or inconsistent variables are one `error:` line and exit code 2 before anything starts.
"""

import os
import runpy
import sys
from typing import NamedTuple

SKYPILOT_PORT = "29500"
LAUNCH_FLAGS = ("--num_machines", "--machine_rank", "--main_process_ip", "--main_process_port", "--num_processes")


class Node(NamedTuple):
    """This node's place in the job, and the names of the variables it came from (for the error lines)."""

    machines: int
    rank: int
    address: str
    port: int
    per_node: int  # processes on each node
    rank_name: str
    nodes_name: str


class ClusterError(Exception):
    """A variable the launch needs is missing or does not fit the others; the message names it and the fix."""


def integer(name: str, value: str | None, minimum: int) -> int:
    if value is None or value == "":
        raise ClusterError(f"{name} is not set")
    if not value.strip().isdigit() or int(value) < minimum:
        raise ClusterError(f"{name}={value!r} is not an integer >= {minimum}")
    return int(value)


def first(env: dict, *names: str) -> tuple[str, str | None]:
    """The first of `names` that is set, and its value (the last name and None if none is)."""
    for name in names:
        if env.get(name):
            return name, env[name]
    return names[-1], None


def kubeflow(env: dict) -> Node:
    nodes_value = env.get("PET_NNODES", "")
    if ":" in nodes_value:  # an elasticPolicy: a range of pods, which accelerate launch's fixed counts can't express
        raise ClusterError(f"PET_NNODES={nodes_value!r} is an elastic range; remove the PyTorchJob's elasticPolicy")
    nodes = integer("PET_NNODES", nodes_value, 1)
    per_node_value = env.get("PET_NPROC_PER_NODE")
    if per_node_value == "auto":
        raise ClusterError('PET_NPROC_PER_NODE is "auto"; set the PyTorchJob\'s nprocPerNode to the GPUs per pod')
    per_node = integer("PET_NPROC_PER_NODE", per_node_value, 1)
    rank_name, rank_value = first(env, "PET_NODE_RANK", "RANK")
    rank = integer(rank_name, rank_value, 0)
    address_name, address = first(env, "PET_MASTER_ADDR", "MASTER_ADDR")
    if not address:
        raise ClusterError(f"{address_name} is not set")
    port = integer(*first(env, "PET_MASTER_PORT", "MASTER_PORT"), 1)
    return Node(nodes, rank, address, port, per_node, rank_name=rank_name, nodes_name="PET_NNODES")


def skypilot(env: dict) -> Node:
    nodes = integer("SKYPILOT_NUM_NODES", env.get("SKYPILOT_NUM_NODES"), 1)
    rank = integer("SKYPILOT_NODE_RANK", env.get("SKYPILOT_NODE_RANK"), 0)
    ips = (env.get("SKYPILOT_NODE_IPS") or "").split()
    if len(ips) != nodes:
        raise ClusterError(f"SKYPILOT_NODE_IPS lists {len(ips)} addresses for SKYPILOT_NUM_NODES={nodes}")
    gpus = integer("SKYPILOT_NUM_GPUS_PER_NODE", env.get("SKYPILOT_NUM_GPUS_PER_NODE"), 0)
    port = integer("MAIN_PROCESS_PORT", env.get("MAIN_PROCESS_PORT", SKYPILOT_PORT), 1)
    return Node(nodes, rank, ips[0], port, max(gpus, 1), rank_name="SKYPILOT_NODE_RANK",
                nodes_name="SKYPILOT_NUM_NODES")  # fmt: skip


def launch_args(env: dict) -> list[str]:
    """The `accelerate launch` flags for this node, from the cluster's variables."""
    is_kubeflow, is_skypilot = "PET_NNODES" in env, "SKYPILOT_NUM_NODES" in env
    if is_kubeflow == is_skypilot:
        found = "both" if is_kubeflow else "neither"
        raise ClusterError(f"found {found} of PET_NNODES (Kubeflow) and SKYPILOT_NUM_NODES (SkyPilot); run this in "
                           "a PyTorchJob pod or a SkyPilot task, or launch with scripts/launch.py")  # fmt: skip
    node = kubeflow(env) if is_kubeflow else skypilot(env)
    if node.rank >= node.machines:
        raise ClusterError(f"{node.rank_name}={node.rank} is not below {node.nodes_name}={node.machines}")
    values = [node.machines, node.rank, node.address, node.port, node.machines * node.per_node]
    return [word for flag, value in zip(LAUNCH_FLAGS, values, strict=True) for word in (flag, str(value))]


def main() -> None:
    args = sys.argv[1:]
    try:
        given = [flag for flag in LAUNCH_FLAGS if any(a == flag or a.startswith(flag + "=") for a in args)]
        if given:
            raise ClusterError(f"{given[0]} comes from the cluster's variables; remove it from the command")
        flags = launch_args(dict(os.environ))
    except ClusterError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from scripts.launch import exit_if_unusable

    exit_if_unusable(args)
    # `python -m accelerate.commands.launch FLAGS ARGS` in this process (scripts/launch.py execs a new one): one
    # interpreter start less on every node
    sys.argv = ["accelerate-launch", *flags, *args]
    runpy.run_module("accelerate.commands.launch", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
