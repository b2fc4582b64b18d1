"""Kubernetes (Kubeflow PyTorchJob) and SkyPilot: the manifests in deploy/, checked offline, and
scripts/cluster_launch.py, which maps the cluster's variables onto `accelerate launch`.

No cluster runs here. The manifests are parsed (kinds, replicas, restart policy, the repository paths they name,
their command = the one docs/launching.md shows); the mapping is run for real: the manifest's command runs in 2
"pods" (or nodes), 2 local processes, each with the variables the operator (or SkyPilot) would set, 1 CPU process
each, and must train as 1 process does; the Kubeflow pods are killed once and restarted, and must resume.
"""

import re
import shlex
import subprocess
import sys

import pytest
import yaml

from scripts.cluster_launch import ClusterError, launch_args
from tests.conftest import (
    REPO,
    WRAPPER,
    assert_ok,
    assert_processes,
    command_env,
    free_port,
    read_metrics,
    run_main,
    series,
    signal_at,
)
from tests.helpers import assert_bash_blocks_run, assert_error_line

PYTORCHJOB = REPO / "deploy" / "kubernetes" / "pytorchjob.yaml"
SKYPILOT = REPO / "deploy" / "skypilot" / "train.yaml"
# 8 steps of the default digits example at the learning rate where 1 and 2 processes agree to float rounding
SAME_RUN = ["--learning_rate", "1e-3", "--max_steps", "8", "--logging_steps", "1", "--eval_steps", "1000",
            "--save_steps", "4"]  # fmt: skip
# what the operator sets in a PyTorchJob pod besides PET_NODE_RANK/RANK (kubeflow/training-operator
# pkg/controller.v1/pytorch/envvar.go, master.go): WORLD_SIZE is replicas x nprocPerNode
KUBEFLOW_POD = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "0"}


def pytorchjob() -> dict:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(PYTORCHJOB.read_text())}


def pod_command() -> list[str]:
    """The Master pod's command (the Worker's is the same: one pod template)."""
    return pytorchjob()["PyTorchJob"]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0][
        "command"
    ]


def docs_yaml(heading: str) -> dict:
    """The first ```yaml block of docs/kubernetes.md's `## <heading>` section."""
    text = (REPO / "docs" / "kubernetes.md").read_text()
    section = re.split(r"^## ", text.split(f"\n## {heading}\n", 1)[1], flags=re.MULTILINE)[0]
    return yaml.safe_load(re.search(r"^```yaml\n(.*?)^```", section, flags=re.DOTALL | re.MULTILINE).group(1))


def assert_names_existing_files(command: list[str]) -> None:
    """Every word that looks like a path inside the repository (scripts/..., configs/..., train.py) exists."""
    paths = [word for word in command if re.fullmatch(r"[\w./-]+\.(py|yaml|sh)", word)]
    assert len(paths) >= 4, command  # the launcher, the accelerate config, train.py, the run config
    for path in paths:
        assert (REPO / path).is_file(), f"the manifest names {path}, which is not in the repository"


# --- the manifests, offline ---


def test_pytorchjob_manifest_restarts_failed_pods_and_runs_the_documented_command():
    docs = pytorchjob()
    job, claim = docs["PyTorchJob"], docs["PersistentVolumeClaim"]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert all(spec["restartPolicy"] == "OnFailure" for spec in replicas.values())
    for spec in replicas.values():
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch"  # the operator adds its variables and port to this container only
        assert container["command"] == docs_yaml("Kubernetes")["command"]
        assert_names_existing_files(container["command"])
        assert container["command"][-2:] == ["--resume_from_checkpoint", "latest"]  # a restarted pod resumes
        # one process per GPU the pod gets
        assert int(job["spec"]["nprocPerNode"]) == container["resources"]["limits"]["nvidia.com/gpu"]
        # the run directory is on the shared claim, mounted in every pod
        output_dir = container["command"][container["command"].index("--output_dir") + 1]
        (mount,) = [m for m in container["volumeMounts"] if output_dir.startswith(m["mountPath"] + "/")]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every pod writes to it


def test_skypilot_task_runs_the_documented_command_on_every_node():
    task = yaml.safe_load(SKYPILOT.read_text())
    assert task["num_nodes"] >= 2 and task["workdir"] == "."
    assert task["run"] == docs_yaml("SkyPilot")["run"]
    command = shlex.split(task["run"])
    assert_names_existing_files(command)
    assert command[-2:] == ["--resume_from_checkpoint", "latest"]
    output_dir = command[command.index("--output_dir") + 1]
    assert any(output_dir.startswith(mount + "/") for mount in task["volumes"])  # one folder every node sees
    assert "MAIN_PROCESS_PORT" in task["envs"]
    setup = task["setup"].split()
    assert (REPO / setup[setup.index("-r") + 1]).is_file()


# --- the mapping, in this process ---


def flags(args: list[str]) -> dict[str, str]:
    return dict(zip(args[::2], args[1::2], strict=True))


@pytest.mark.parametrize(
    "env",
    [
        {"PET_NODE_RANK": "1", "PET_MASTER_ADDR": "train-digits-master-0", "PET_MASTER_PORT": "23456"},
        {"RANK": "1", "MASTER_ADDR": "train-digits-master-0", "MASTER_PORT": "23456"},  # older operators
    ],
    ids=["pet", "older-operator"],
)
def test_kubeflow_variables_become_the_launch_flags(env):
    """2 pods x 8 GPUs: 16 processes; the master's service name as the address, never a 127.0.0.1 default."""
    launch = flags(launch_args({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "WORLD_SIZE": "16", **env}))
    assert launch == {"--num_machines": "2", "--machine_rank": "1", "--main_process_ip": "train-digits-master-0",
                      "--main_process_port": "23456", "--num_processes": "16"}  # fmt: skip


def test_skypilot_variables_become_the_launch_flags():
    env = {"SKYPILOT_NUM_NODES": "3", "SKYPILOT_NODE_RANK": "2", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n10.0.0.7",
           "SKYPILOT_NUM_GPUS_PER_NODE": "8"}  # fmt: skip
    launch = flags(launch_args(env))
    assert launch == {"--num_machines": "3", "--machine_rank": "2", "--main_process_ip": "10.0.0.5",
                      "--main_process_port": "29500", "--num_processes": "24"}  # fmt: skip
    cpu_nodes = flags(launch_args({**env, "SKYPILOT_NUM_GPUS_PER_NODE": "0", "MAIN_PROCESS_PORT": "8008"}))
    assert (cpu_nodes["--num_processes"], cpu_nodes["--main_process_port"]) == ("3", "8008")  # 1 process a node


KUBEFLOW = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m",
            "PET_MASTER_PORT": "23456"}  # fmt: skip
SKY = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6",
       "SKYPILOT_NUM_GPUS_PER_NODE": "8"}  # fmt: skip
BAD = {
    "no cluster": ({}, "neither of PET_NNODES .Kubeflow. and SKYPILOT_NUM_NODES"),
    "both clusters": ({**KUBEFLOW, **SKY}, "both of PET_NNODES"),
    "no address": ({**KUBEFLOW, "PET_MASTER_ADDR": ""}, "MASTER_ADDR is not set"),
    "no port": ({**KUBEFLOW, "PET_MASTER_PORT": ""}, "MASTER_PORT is not set"),
    "elastic": ({**KUBEFLOW, "PET_NNODES": "1:4"}, "PET_NNODES='1:4' is an elastic range; remove the .* elasticPolicy"),
    "auto": ({**KUBEFLOW, "PET_NPROC_PER_NODE": "auto"}, "set the PyTorchJob's nprocPerNode to the GPUs per pod"),
    "rank too high": ({**KUBEFLOW, "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is not below PET_NNODES=2"),
    "not a number": ({**KUBEFLOW, "PET_NNODES": "two"}, "PET_NNODES='two' is not an integer >= 1"),
    "ips": ({**SKY, "SKYPILOT_NODE_IPS": "10.0.0.5"}, "SKYPILOT_NODE_IPS lists 1 addresses for SKYPILOT_NUM_NODES=2"),
    "no gpus variable": ({**SKY, "SKYPILOT_NUM_GPUS_PER_NODE": None}, "SKYPILOT_NUM_GPUS_PER_NODE is not set"),
}


@pytest.mark.parametrize("case", BAD)
def test_missing_or_inconsistent_variables_are_refused(case):
    env, pattern = BAD[case]
    with pytest.raises(ClusterError, match=pattern):
        launch_args({k: v for k, v in env.items() if v is not None})


def test_the_script_refuses_with_one_line_before_anything_starts(tmp_path):
    """As a command: exit 2, one `error:` line, no run directory (the refusal comes before accelerate's import)."""
    out = tmp_path / "run"
    command = [sys.executable, "scripts/cluster_launch.py", "train.py", "--output_dir", str(out)]
    refused = subprocess.run(command, cwd=REPO, env=command_env({**KUBEFLOW, "PET_NODE_RANK": "5"}),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert_error_line(refused, r"PET_NODE_RANK=5 is not below PET_NNODES=2")
    given = [sys.executable, "scripts/cluster_launch.py", "--num_processes", "4", "train.py"]
    refused = subprocess.run(given, cwd=REPO, env=command_env(KUBEFLOW), capture_output=True, text=True, timeout=60)
    assert_error_line(refused, r"--num_processes comes from the cluster's variables; remove it")
    assert not out.exists()


# --- 2 pods on this machine, trained as 1 process ---


def start_pods(manifest_command: list[str], output_dir, pod_env: list[dict], script: str = "train.py"):
    """The manifest's command in every pod, all at once (each waits for the others at the rendezvous), shortened
    and with a shared output_dir (the claim); `script` in place of train.py."""
    assert manifest_command[:2] == ["python", "scripts/cluster_launch.py"], manifest_command
    words = [script if word == "train.py" else word for word in manifest_command[1:]]
    command = [sys.executable, *words, *SAME_RUN, "--output_dir", str(output_dir)]
    pods = [subprocess.Popen(command, cwd=REPO, env=command_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, stdin=subprocess.DEVNULL) for env in pod_env]  # fmt: skip
    results = []
    for pod in pods:
        try:
            stdout, stderr = pod.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for other in pods:
                other.kill()
            raise
        results.append(subprocess.CompletedProcess(command, pod.returncode, stdout, stderr))
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    assert_ok(run_main("--config", "configs/default.yaml", *SAME_RUN, "--output_dir", str(out)))
    return out


@pytest.fixture(scope="module")
def kubeflow_pods(tmp_path_factory):
    """The master pod (PET_NODE_RANK 0, RANK 0) and the worker (1, 1), rendezvous at the master's address. Their
    processes are killed at step 5 (checkpoint at 4) and the pods started again with the same command, as
    `restartPolicy: OnFailure` restarts them: the second start resumes."""
    folder = tmp_path_factory.mktemp("kubeflow")
    out, port = folder / "run", str(free_port())
    address = {"PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": port, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    pods = [{**KUBEFLOW_POD, **address, "PET_NODE_RANK": rank, "RANK": rank} for rank in ("0", "1")]
    killed = folder / "killed_at_step_5.py"
    killed.write_text(WRAPPER.format(repo=str(REPO), hook=signal_at(5), extra=""))
    first = start_pods(pod_command(), out, pods, script=str(killed))
    assert all(pod.returncode != 0 for pod in first), [pod.returncode for pod in first]
    assert (out / "checkpoints" / "step_4").is_dir() and not (out / "checkpoints" / "step_8").exists()
    return out, start_pods(pod_command(), out, pods)


@pytest.fixture(scope="module")
def skypilot_nodes(tmp_path_factory):
    """2 CPU nodes (SKYPILOT_NUM_GPUS_PER_NODE=0: one process each); the head is the first of SKYPILOT_NODE_IPS."""
    out = tmp_path_factory.mktemp("skypilot") / "run"
    node = {"SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "127.0.0.1\n127.0.0.2", "SKYPILOT_NUM_GPUS_PER_NODE": "0",
            "MAIN_PROCESS_PORT": str(free_port())}  # fmt: skip
    command = shlex.split(yaml.safe_load(SKYPILOT.read_text())["run"])
    return out, start_pods(command, out, [{**node, "SKYPILOT_NODE_RANK": rank} for rank in ("0", "1")])


def assert_trained_as_one_process(run, one_process):
    out, pods = run
    for pod in pods:
        assert_ok(pod)
    assert_processes(out, 2)  # every start: the 2 pods formed one group, not 2 separate 1-process runs
    losses, reference = (series(read_metrics(path), "train/loss") for path in (out, one_process))
    assert list(losses) == list(reference) == list(range(1, 9))  # each step once, a restart included
    assert max(abs(losses[step] - reference[step]) for step in reference) <= 1e-5


@pytest.mark.slow
def test_two_kubeflow_pods_killed_and_restarted_train_as_one_process(kubeflow_pods, one_process):
    out, _ = kubeflow_pods
    assert [row["setup/world_size"] for row in read_metrics(out) if "setup/world_size" in row] == [2, 2]  # 2 starts
    assert_trained_as_one_process(kubeflow_pods, one_process)


@pytest.mark.slow
def test_two_skypilot_nodes_train_as_one_process(skypilot_nodes, one_process):
    assert_trained_as_one_process(skypilot_nodes, one_process)


def test_the_docs_page_commands_are_run_here():
    assert_bash_blocks_run("docs/kubernetes.md")
