"""--output_mirror (src/features/object_storage/): checkpoints, model/ and metrics.jsonl in object storage, against a
real local S3 server (moto's, started here from .venv/tools/s3_server; the runs reach it through s3fs with
AWS_ENDPOINT_URL). A run killed, its
disk wiped, resumes from the bucket with the uninterrupted run's losses; an upload cut off half-way is never
`latest`; --save_total_limit rotates the bucket; bad input is one line before anything is written."""

import importlib.util
import itertools
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from scripts.readme_commands import section_commands
from src.checkpoint import TrainerState, checkpoint_dir
from src.config import TrainConfig
from tests.conftest import (
    QUICK,
    REPO,
    assert_ok,
    free_port,
    read_metrics,
    run_main,
    run_snippet,
    run_with_hook,
    signal_at,
)
from tests.helpers import as_written, assert_bash_blocks_run, assert_error_line, train_losses, workspace

RUN = ["--max_steps", "8", "--logging_steps", "1", "--save_steps", "2", "--eval_steps", "1000"]  # 4 checkpoints
BUCKETS = (f"bucket-{i}" for i in itertools.count())
# moto's server, installed by `bash scripts/setup.sh --dev` from requirements/tools/s3_server.txt into a folder of its
# own: in the venv, its boto3 would be imported by every run's `import accelerate`
S3_SERVER = Path(sys.prefix) / "tools" / "s3_server"


class S3:
    """moto's S3 server on a free local port; `env`: what a run needs to reach it (fake credentials)."""

    def __init__(self, endpoint: str):
        import botocore.session  # s3fs's own client library (through aiobotocore), used here without s3fs

        self.env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookup for credentials
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials",  # nor this machine's own
            "AWS_CONFIG_FILE": "/nonexistent/config",
            "AWS_PROFILE": None,
            "AWS_SESSION_TOKEN": None,
        }
        keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}
        self.client = botocore.session.get_session().create_client("s3", endpoint_url=endpoint, **keys)

    def bucket(self) -> str:
        name = next(BUCKETS)
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def read(self, bucket: str, key: str) -> bytes:
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def copy(self, bucket: str) -> str:
        """A new bucket holding `bucket`'s objects: a run's state that several tests continue, each in its own."""
        name = self.bucket()
        for key in self.keys(bucket):
            self.client.copy_object(Bucket=name, Key=key, CopySource={"Bucket": bucket, "Key": key})
        return name

    def checkpoints(self, bucket: str) -> dict[str, list[str]]:
        """step_<N> -> the names of its files in the bucket's run/checkpoints/."""
        found = {}
        for key in self.keys(bucket, "run/checkpoints/"):
            step, _, name = key.removeprefix("run/checkpoints/").partition("/")
            found.setdefault(step, []).append(name)
        return found


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("s3fs")
    if not (S3_SERVER / "moto").is_dir():
        pytest.skip(f"moto's S3 server is not in {S3_SERVER}: bash scripts/setup.sh --dev installs it")
    port, log = free_port(), tmp_path_factory.mktemp("s3_server") / "server.log"  # it logs every request
    with log.open("w") as output:
        command = [sys.executable, "-m", "moto.server", "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "PYTHONPATH": str(S3_SERVER)}
        server = subprocess.Popen(command, env=env, stdout=output, stderr=output)
    try:
        deadline = time.monotonic() + 120
        while not port_open(port):
            if server.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto's S3 server did not start: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield S3(f"http://127.0.0.1:{port}")
    finally:
        server.terminate()
        server.wait(timeout=30)


def port_open(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def mirrored(out: Path, bucket: str, *more: str) -> list[str]:
    return [*RUN, "--output_dir", str(out), "--output_mirror", f"s3://{bucket}/run", *more]


@pytest.fixture(scope="module")
def uninterrupted(s3, tmp_path_factory):
    """One run to the end with a mirror: (its local run directory, its bucket, its per-step train losses)."""
    out = tmp_path_factory.mktemp("full") / "run"
    bucket = s3.bucket()
    assert_ok(run_main(*mirrored(out, bucket), env=s3.env))
    return out, bucket, train_losses(out)[0]


def assert_bucket_holds_the_run(s3, bucket: str, out: Path) -> None:
    """model/, metrics.jsonl, config.yaml, eval_results.json and the kept checkpoints: byte for byte the local ones."""
    local = sorted(
        path.relative_to(out).as_posix()
        for name in ("model", "checkpoints", "metrics.jsonl", "config.yaml", "eval_results.json")
        for path in ([out / name] if (out / name).is_file() else (out / name).rglob("*"))
        if path.is_file()
    )
    assert s3.keys(bucket, "run/") == [f"run/{name}" for name in local]
    for name in local:
        assert s3.read(bucket, f"run/{name}") == (out / name).read_bytes(), name


@pytest.mark.slow
def test_the_bucket_holds_the_run_rotated_like_the_disk(s3, uninterrupted, tmp_path):
    """--save_total_limit 2 (the default): of the checkpoints at steps 2, 4, 6 and 8 the bucket keeps 6 and 8, as the
    disk does; model/, metrics.jsonl and the rest are the local files. The run trains as one without a mirror."""
    out, bucket, losses = uninterrupted
    assert list(losses) == list(range(1, 9))
    assert_ok(run_main(*RUN, "--output_dir", str(tmp_path / "plain")))
    assert train_losses(tmp_path / "plain")[0] == losses
    assert (
        sorted(s3.checkpoints(bucket))
        == ["step_6", "step_8"]
        == sorted(p.name for p in (out / "checkpoints").iterdir())
    )
    assert "model.safetensors" in s3.keys(bucket, "run/model/")[0]
    assert_bucket_holds_the_run(s3, bucket, out)


@pytest.fixture(scope="module")
def killed_at_step_5(s3, tmp_path_factory):
    """A 1-process run with a mirror SIGKILLed at step 5: the bucket that it left (step_2 and step_4), which the
    resume tests below continue, each from a copy of its own, on a wiped disk (they never read the local folder)."""
    out, bucket = tmp_path_factory.mktemp("killed") / "run", s3.bucket()
    killed = run_with_hook(out.parent, mirrored(out, bucket, "--resume_from_checkpoint", "latest"), signal_at(5),
                           env=s3.env)  # fmt: skip
    assert killed.returncode == -9
    assert sorted(s3.checkpoints(bucket)) == ["step_2", "step_4"]
    return bucket


@pytest.mark.slow
def test_killed_run_resumes_from_the_bucket_on_an_empty_disk(s3, uninterrupted, killed_at_step_5, tmp_path):
    """SIGKILL at step 5, the local run directory deleted (a fresh machine), the same command again: it downloads
    step_4 from the bucket and logs the uninterrupted run's per-step losses, bit for bit."""
    out, bucket = tmp_path / "run", s3.copy(killed_at_step_5)
    resumed = run_main(*mirrored(out, bucket, "--resume_from_checkpoint", "latest"), env=s3.env)
    assert_ok(resumed)
    log = resumed.stdout + resumed.stderr
    assert "downloading checkpoint step_4" in log and "at step 4" in log
    losses, _ = train_losses(out)
    assert list(losses) == list(range(1, 9))  # each step once: metrics.jsonl came from the bucket, up to step 4
    assert losses == uninterrupted[2]
    assert_bucket_holds_the_run(s3, bucket, out)


@pytest.mark.slow
def test_two_processes_upload_from_the_main_one_and_resume_from_the_bucket(s3, uninterrupted, killed_at_step_5,
                                                                           tmp_path):  # fmt: skip
    """DDP on 2 CPU processes continuing the killed run on a wiped disk: the resume downloads once for both, the main
    process uploads step_6, step_8 and the end's files while the other waits; the per-step losses are the 1-process
    uninterrupted run's to 1e-5 (README: 1 = 2 processes)."""
    out, bucket = tmp_path / "run", s3.copy(killed_at_step_5)
    resumed = run_with_hook(tmp_path, mirrored(out, bucket, "--resume_from_checkpoint", "latest"), processes=2,
                            env=s3.env)  # fmt: skip
    assert_ok(resumed)
    starts = [row["setup/world_size"] for row in read_metrics(out) if "setup/world_size" in row]
    assert starts == [1, 2]  # the killed start (its metrics.jsonl from the bucket), then the 2 processes' start
    assert (resumed.stdout + resumed.stderr).count("downloading checkpoint step_4") == 1
    losses, expected = train_losses(out)[0], uninterrupted[2]
    assert list(losses) == list(expected) and max(abs(losses[s] - expected[s]) for s in losses) <= 1e-5
    assert sorted(s3.checkpoints(bucket)) == ["step_6", "step_8"]  # uploaded by the 2 processes, step_4 rotated out
    assert_bucket_holds_the_run(s3, bucket, out)


UPLOAD_DIES = """
import asyncio, s3fs
put_file = s3fs.S3FileSystem._put_file
pending = set()
async def put_or_die(self, lpath, rpath, *args, **kwargs):  # step_4's optimizer.bin never arrives: SIGKILL once the
    pending.add(rpath)                                       # rest of its batch is in the bucket
    if rpath.endswith("/checkpoints/step_4/optimizer.bin"):
        while len(pending) > 1:
            await asyncio.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    await put_file(self, lpath, rpath, *args, **kwargs)
    pending.discard(rpath)
s3fs.S3FileSystem._put_file = put_or_die
"""


@pytest.mark.slow
def test_upload_killed_half_way_leaves_latest_at_the_previous_checkpoint(s3, uninterrupted, tmp_path):
    """Killed while step_4 uploads (all but its optimiser state in the bucket): on a wiped disk `latest` is step_2,
    the run goes on from there with the uninterrupted losses, and the half-uploaded step_4 is replaced."""
    out, bucket = tmp_path / "run", s3.bucket()
    args = mirrored(out, bucket, "--resume_from_checkpoint", "latest")
    killed = run_with_hook(tmp_path, args, extra=UPLOAD_DIES, env=s3.env)
    assert killed.returncode == -9
    checkpoints = s3.checkpoints(bucket)
    assert sorted(checkpoints) == ["step_2", "step_4"]
    assert "trainer_state.json" in checkpoints["step_2"]
    assert checkpoints["step_4"] == [
        "config.yaml",
        "custom_checkpoint_0.pkl",
        "model.safetensors",
        "random_states_0.pkl",
    ]
    shutil.rmtree(out)

    resumed = run_main(*args, env=s3.env)
    assert_ok(resumed)
    log = resumed.stdout + resumed.stderr
    assert "downloading checkpoint step_2" in log and "at step 2" in log
    assert train_losses(out)[0] == uninterrupted[2]
    assert_bucket_holds_the_run(s3, bucket, out)  # step_6 and step_8 only: no half of step_4 left


@pytest.mark.slow
def test_uploads_on_a_thread_leave_the_bucket_as_uploads_in_place(s3, uninterrupted, tmp_path, monkeypatch):
    """--output_mirror_async true: each checkpoint uploaded on its own thread, the end's files on the main one; the
    same losses, and the same bucket byte for byte, as the run that uploads in place. In this process, s3fs's put
    noting the thread it runs on."""
    import threading

    import s3fs

    out, bucket, threads = tmp_path / "run", s3.bucket(), []
    put = s3fs.S3FileSystem.put

    def put_noting_the_thread(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return put(self, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "put", put_noting_the_thread)
    s3fs.S3FileSystem.clear_instance_cache()  # (a cached instance holds the put it was made with; so would this run's)
    try:
        assert_ok(run_main(*mirrored(out, bucket, "--output_mirror_async", "true"), env=s3.env))
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert set(threads) == {"MainThread", *(f"upload step_{n}" for n in (2, 4, 6, 8))}
    assert train_losses(out)[0] == uninterrupted[2]
    assert sorted(s3.checkpoints(bucket)) == ["step_6", "step_8"]
    assert_bucket_holds_the_run(s3, bucket, out)


# id -> (the run's --output_mirror given a bucket, the env on top of s3.env, what the error line says)
BAD = {
    "unreachable endpoint": (
        lambda bucket: f"s3://{bucket}/run",
        lambda: {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"},
        r"cannot use --output_mirror s3://.*EndpointConnectionError.*AWS_ENDPOINT_URL",
    ),
    "missing bucket": (lambda bucket: "s3://no-such-bucket/run", dict, r"no such bucket .*create it first"),
    "missing credentials": (
        lambda bucket: f"s3://{bucket}/run",
        lambda: {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
        r"no credentials.*AWS_ACCESS_KEY_ID",
    ),
    "unknown protocol": (lambda bucket: "nosuch://bucket/run", dict, r"Protocol not known: nosuch"),
    "library missing": (lambda bucket: "gs://bucket/run", dict, r"needs gcsfs: pip install gcsfs"),
    "not a url": (lambda bucket: "bucket/run", dict, r"is not a URL; use one like s3://bucket/run"),
}


@pytest.mark.slow
def test_an_output_dir_url_is_refused_with_the_mirror_option_named(tmp_path):
    result = run_main(*QUICK, "--output_dir", "s3://bucket/run")
    assert_error_line(result, r"--output_dir s3://bucket/run is a URL; keep --output_dir a local folder")
    assert not (REPO / "s3:").exists()


STOPPED_MID_UPLOAD = """
import sys, threading, time
from pathlib import Path
import fsspec.implementations.local
from src.checkpoint import TrainerState, checkpoint_dir
from src.config import TrainConfig
from src.features.object_storage.mirror import upload_checkpoint

class MainProcess:  # the accelerator's part that upload_checkpoint uses, for one process
    is_main_process, num_processes = True, 1
    def wait_for_everyone(self):
        pass

out = Path(sys.argv[1])
(checkpoint_dir(out, 2)).mkdir(parents=True)
(checkpoint_dir(out, 2) / "trainer_state.json").write_text("{}")
put = fsspec.implementations.local.LocalFileSystem.put
def put_once_the_main_thread_ended(self, *args, **kwargs):
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    return put(self, *args, **kwargs)
fsspec.implementations.local.LocalFileSystem.put = put_once_the_main_thread_ended
mirrored = {"output_mirror": f"file://{sys.argv[2]}", "output_mirror_async": True}
config = TrainConfig(output_dir=str(out), feature_args=mirrored)
upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 2), TrainerState(step=2))
raise ValueError("the task failed")
"""


def test_a_run_stopped_by_an_error_finishes_the_upload_in_flight(tmp_path):
    result = run_snippet(STOPPED_MID_UPLOAD, str(tmp_path / "run"), str(tmp_path / "mirror"))
    assert result.returncode == 1 and "ValueError: the task failed" in result.stderr
    assert (tmp_path / "mirror" / "checkpoints" / "step_2" / "trainer_state.json").is_file()


def test_uploads_on_a_thread_need_a_mirror_and_a_file_mirror_an_absolute_path(tmp_path):
    from src.cli import parse_config
    from src.errors import UsageError
    from src.features.object_storage.mirror import check_mirror

    with pytest.raises(UsageError, match=r"--output_mirror_async uploads to --output_mirror: set it too"):
        parse_config(["--output_mirror_async", "true"])
    with pytest.raises(UsageError, match=r"file://tmp/run has no absolute path; use file:///absolute/path"):
        check_mirror(TrainConfig(output_dir=str(tmp_path / "run"), feature_args={"output_mirror": "file://tmp/run"}))


@pytest.mark.slow
@pytest.mark.parametrize("case", BAD)
def test_bad_mirror_is_one_line_before_anything_is_written(s3, tmp_path, case):
    if case == "library missing" and importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed here")
    url, env, pattern = BAD[case]
    bucket, out = s3.bucket(), tmp_path / "run"
    result = run_main(*QUICK, "--output_dir", str(out), "--output_mirror", url(bucket), env={**s3.env, **env()})
    assert_error_line(result, pattern)
    assert not out.exists() and s3.keys(bucket) == []


def test_the_start_check_gives_up_after_its_own_two_retries(monkeypatch):
    """An endpoint that resets every connection: the start's check is one error line from a client of its own with 2
    retries and a 5 s connect timeout (CHECK_OPTIONS), where a client with botocore's defaults keeps trying and waits
    between tries: a run with a wrong endpoint says so at once instead of after a minute."""
    pytest.importorskip("s3fs")
    from src.errors import UsageError
    from src.features.object_storage.mirror import check_mirror

    listener = socket.create_server(("127.0.0.1", 0))
    attempts = []

    def reset_every_connection():
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            attempts.append(connection)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            connection.close()

    threading.Thread(target=reset_every_connection, daemon=True).start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent"}  # fmt: skip
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    import fsspec.core

    clients, url_to_fs = [], fsspec.core.url_to_fs

    def recording(url, **options):  # the client the check makes: its retry and timeout settings
        clients.append(options.get("config_kwargs"))
        return url_to_fs(url, **options)

    monkeypatch.setattr(fsspec.core, "url_to_fs", recording)
    try:
        with pytest.raises(UsageError, match=r"cannot use --output_mirror s3://bucket/run: EndpointConnectionError"):
            check_mirror(TrainConfig(output_dir="unused", feature_args={"output_mirror": "s3://bucket/run"}))
    finally:
        listener.close()
    retries = clients[0]["retries"]  # botocore rewrites the dict it is given into the total of attempts
    attempts_allowed = retries.get("total_max_attempts", 1 + retries.get("max_attempts", 0))
    assert clients[0]["connect_timeout"] == 5 and attempts_allowed == 3
    # botocore's 3, which s3fs's own retry may repeat on a loaded machine (6 seen once in 4 runs beside other jobs):
    # a bound on the count, not a timing; the client's settings above are what the check is made of
    assert 1 <= len(attempts) <= 3 * attempts_allowed, f"{len(attempts)} connection attempts"


@pytest.mark.slow
def test_a_bucket_holding_another_run_is_refused_unless_continued_or_replaced(s3, tmp_path):
    bucket, out = s3.bucket(), tmp_path / "run"
    s3.client.put_object(Bucket=bucket, Key="run/checkpoints/step_2/trainer_state.json", Body=b"{}")
    refused = run_main(*QUICK, "--output_dir", str(out), "--output_mirror", f"s3://{bucket}/run", env=s3.env)
    assert_error_line(refused, r"already holds a run .*--resume_from_checkpoint latest.*--overwrite_output_dir")
    another_folders = ["--resume_from_checkpoint", str(tmp_path / "other" / "checkpoints" / "step_2")]  # a new run
    refused = run_main(*QUICK, *another_folders, "--output_dir", str(out), "--output_mirror", f"s3://{bucket}/run",
                       env=s3.env)  # fmt: skip
    assert_error_line(refused, r"already holds a run .*--resume_from_checkpoint latest.*--overwrite_output_dir")
    assert not out.exists() and s3.keys(bucket) == ["run/checkpoints/step_2/trainer_state.json"]

    replaced = run_main(*QUICK, "--output_dir", str(out), "--output_mirror", f"s3://{bucket}/run",
                        "--overwrite_output_dir", "true", env=s3.env)  # fmt: skip
    assert_ok(replaced)
    assert sorted(s3.checkpoints(bucket)) == ["step_6"]  # the other run's step_2 removed: never this run's latest


@pytest.mark.slow
def test_docs_command_resumes_on_a_fresh_machine(s3, tmp_path):
    """docs/object_storage.md's command as written, in a folder with its own runs/: a first start, the local runs/
    deleted, the same command again: it continues from the bucket's checkpoint. Both starts are `python train.py`
    (1 process), so they run as train.main calls in this process."""
    (command,) = section_commands("Checkpoints in object storage", page="docs/object_storage.md")
    _, script, *args = as_written(command)
    assert script == "train.py", command
    s3.client.create_bucket(Bucket="my-bucket")
    cwd = workspace(tmp_path)
    assert_ok(run_main(*args, *QUICK, cwd=cwd, env=s3.env))
    shutil.rmtree(cwd / "runs")
    second = run_main(*args, "--max_steps", "8", "--logging_steps", "2", cwd=cwd, env=s3.env)
    assert_ok(second)
    assert "downloading checkpoint step_6" in second.stdout + second.stderr
    steps = [row["step"] for row in read_metrics(cwd / "runs" / "exp1") if "train/loss" in row]
    assert steps == [2, 4, 6, 8]
    assert json.loads(s3.read("my-bucket", "exp1/metrics.jsonl").splitlines()[-1])["step"] == 8


@pytest.mark.slow
def test_docs_file_mirror_commands_resume_on_a_wiped_disk(tmp_path):
    """docs/object_storage.md's try without a bucket, as written but for the mirror's folder (the test's): a first run
    of 20 steps, its run directory deleted, the second command downloads step 20 and trains 21-40."""
    first, wipe, second = section_commands("Try it on one machine", page="docs/object_storage.md")
    mirror = tmp_path / "mirror"
    cwd = tmp_path / "work"
    cwd.mkdir()
    workspace(cwd)

    def run(command: str):
        _, script, *args = as_written(command.replace("/tmp/mirror", str(mirror)))
        assert script == "train.py", command
        return run_main(*args, cwd=cwd)

    assert_ok(run(first))
    assert wipe == "rm -rf runs/mirrored"
    shutil.rmtree(cwd / "runs" / "mirrored")
    resumed = run(second)
    assert_ok(resumed)
    assert "downloading checkpoint step_20" in resumed.stdout + resumed.stderr
    assert [row["step"] for row in read_metrics(cwd / "runs" / "mirrored") if "train/loss" in row] == [10, 20, 30, 40]
    assert (mirror / "mirrored" / "checkpoints" / "step_40" / "trainer_state.json").is_file()


class MainProcess:
    """The accelerator's part that src/features/object_storage/mirror.py uses, for one process."""

    is_main_process, num_processes = True, 1

    def wait_for_everyone(self):
        pass


def test_file_mirror_sends_the_trainer_state_last_and_fetches_the_newest_complete(tmp_path, monkeypatch):
    """Without a server (file://): the upload's order; `latest` taken from checkpoints with a trainer state only,
    with the best model's checkpoint that it names."""
    import fsspec.implementations.local

    from src.features.object_storage.mirror import fetch_checkpoint, upload_checkpoint

    out, mirror = tmp_path / "run", tmp_path / "mirror"
    mirrored = {"output_mirror": f"file://{mirror}"}
    config = TrainConfig(output_dir=str(out), feature_args=mirrored, resume_from_checkpoint="latest")
    for step in (2, 4, 6):
        checkpoint = checkpoint_dir(out, step)
        (checkpoint / "model").mkdir(parents=True)
        (checkpoint / "model.safetensors").write_text(f"weights {step}")
        (checkpoint / "model" / "weights").write_text(f"exported {step}")
        (checkpoint / "trainer_state.json").write_text(json.dumps({"step": step, "best_model_step": 2}))
    (out / "metrics.jsonl").write_text('{"step": 6}\n')
    sent = []
    put = fsspec.implementations.local.LocalFileSystem.put
    monkeypatch.setattr(
        fsspec.implementations.local.LocalFileSystem,
        "put",
        lambda self, lpath, rpath, **kw: (sent.extend(Path(p).name for p in lpath), put(self, lpath, rpath, **kw)),
    )
    for step in (2, 4, 6):  # --save_total_limit 2 and the best model's step_2: all three stay
        upload_checkpoint(MainProcess(), config, checkpoint_dir(out, step), TrainerState(step=step, best_model_step=2))
    assert sorted(sent[:2]) == ["model.safetensors", "weights"] and sent[2:4] == ["metrics.jsonl", "trainer_state.json"]
    assert sorted(p.name for p in (mirror / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]
    (mirror / "checkpoints" / "step_6" / "trainer_state.json").unlink()  # as if its upload was cut off before the end
    shutil.rmtree(out)
    fetch_checkpoint(MainProcess(), config)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_2", "step_4"]  # the latest, the best
    assert (checkpoint_dir(out, 4) / "model" / "weights").read_text() == "exported 4"
    assert (out / "metrics.jsonl").read_text() == '{"step": 6}\n'


class HeldPuts:
    """LocalFileSystem.put patched: a put on an upload thread waits for `release`; puts to a path ending in one of
    `failing` raise PermissionError; `threads` notes each put's thread."""

    def __init__(self, monkeypatch):
        import threading

        import fsspec.implementations.local

        self.entered, self.release, self.threads, self.failing = threading.Event(), threading.Event(), [], set()
        put = fsspec.implementations.local.LocalFileSystem.put

        def held_put(fs, lpath, rpath, **kw):
            self.threads.append(threading.current_thread().name)
            if self.threads[-1] != "MainThread":
                self.entered.set()
                assert self.release.wait(30), "never released"
            if any(path.endswith(tuple(self.failing)) for path in rpath):
                raise PermissionError("access denied")
            return put(fs, lpath, rpath, **kw)

        monkeypatch.setattr(fsspec.implementations.local.LocalFileSystem, "put", held_put)


def async_run(tmp_path, steps=(2, 4, 6)) -> tuple[Path, Path, TrainConfig]:
    out, mirror = tmp_path / "run", tmp_path / "mirror"
    for step in steps:
        (checkpoint_dir(out, step)).mkdir(parents=True)
        (checkpoint_dir(out, step) / "model.safetensors").write_text(f"weights {step}")
        (checkpoint_dir(out, step) / "trainer_state.json").write_text(json.dumps({"step": step}))
    (out / "metrics.jsonl").write_text('{"step": 2}\n')
    mirrored = {"output_mirror": f"file://{mirror}", "output_mirror_async": True}
    return out, mirror, TrainConfig(output_dir=str(out), feature_args=mirrored)


def test_an_upload_on_a_thread_sends_its_snapshot_and_the_next_waits_for_it(tmp_path, monkeypatch):
    """--output_mirror_async (file://, no server): the call returns while the upload is held on its thread, the
    disk's rotation may remove the checkpoint meanwhile (the upload reads hard links) and the log goes on; the next
    checkpoint's upload starts only once this one is done; the mirror then holds both, byte for byte."""
    import threading

    from src.features.object_storage.mirror import PENDING, upload_checkpoint, upload_run

    out, mirror, config = async_run(tmp_path)
    puts = HeldPuts(monkeypatch)
    upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 2), TrainerState(step=2))
    assert puts.entered.wait(30) and puts.threads == ["upload step_2"]  # the call returned; the upload is held
    assert not (mirror / "checkpoints").exists()
    linked = out / "checkpoints" / ".tmp_upload_step_2" / "step_2" / "model.safetensors"
    assert linked.stat().st_ino == (checkpoint_dir(out, 2) / "model.safetensors").stat().st_ino  # no byte copied
    shutil.rmtree(checkpoint_dir(out, 2))  # as --save_total_limit would, on the disk
    (out / "metrics.jsonl").write_text('{"step": 2}\n{"step": 3}\n')  # the log goes on; the snapshot has step 2's

    joining, join = threading.Event(), PENDING[0].thread.join
    PENDING[0].thread.join = lambda *args: (joining.set(), join(*args))
    puts.entered.clear()
    next_upload = threading.Thread(
        target=upload_checkpoint, args=(MainProcess(), config, checkpoint_dir(out, 4), TrainerState(step=4))
    )
    next_upload.start()
    for _ in range(3000):  # until it waits for step_2's upload (right) or starts its own (wrong); 30 s at most
        if joining.is_set() or puts.entered.is_set():
            break
        next_upload.join(0.01)
    assert joining.is_set() and not puts.entered.is_set()  # waiting: step_4's upload has not begun
    puts.release.set()
    next_upload.join()
    upload_run(MainProcess(), config)  # the end: waits for step_4's
    assert puts.threads[:6] == ["upload step_2"] * 3 + ["upload step_4"] * 3 and set(puts.threads[6:]) == {"MainThread"}
    assert (mirror / "checkpoints" / "step_2" / "model.safetensors").read_text() == "weights 2"
    assert (mirror / "checkpoints" / "step_4" / "trainer_state.json").is_file()
    assert not list((out / "checkpoints").glob(".tmp_*")) and not PENDING  # the snapshots removed


def test_a_failed_upload_on_a_thread_stops_the_next_and_a_preemption_still_uploads(tmp_path, monkeypatch, caplog):
    """The failure is logged as it happens and stops the run (exit 74) at the next checkpoint, naming the one that
    failed; on another process the line points at the main one's. A preemption's checkpoint is uploaded at once,
    even after a failed upload: then the mirror lacks nothing."""
    from src.errors import CheckpointWriteFailed
    from src.features.object_storage.mirror import PENDING, upload_checkpoint

    out, mirror, config = async_run(tmp_path, steps=(2, 4, 6, 8))
    puts = HeldPuts(monkeypatch)
    puts.release.set()
    puts.failing.add("step_2/model.safetensors")
    upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 2), TrainerState(step=2))
    PENDING[0].thread.join()
    assert "could not upload checkpoint step_2 to file://" in caplog.text  # said at once, whatever comes next
    with pytest.raises(CheckpointWriteFailed, match=r"could not upload checkpoint step_2 to file://.*access denied"):
        upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 4), TrainerState(step=4))
    assert not (mirror / "checkpoints" / "step_2" / "trainer_state.json").exists()  # never taken for latest

    puts.failing.add("step_6/model.safetensors")
    upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 6), TrainerState(step=6))  # fails on its thread
    PENDING[0].thread.join()
    puts.threads.clear()
    upload_checkpoint(MainProcess(), config, checkpoint_dir(out, 8), TrainerState(step=8, preempted=True))
    assert set(puts.threads) == {"MainThread"} and (mirror / "checkpoints" / "step_8" / "trainer_state.json").is_file()
    assert "could not upload checkpoint step_6" in caplog.text and not PENDING

    with pytest.raises(CheckpointWriteFailed, match=r"^an upload on the main process failed \(its error line"):
        upload_checkpoint(OtherProcess(), config, checkpoint_dir(out, 8), TrainerState(step=8))


class OtherProcess(MainProcess):
    """Rank 1 of 2, whose main process failed: the sum of the two agreements is 1."""

    is_main_process, num_processes, device = False, 2, "cpu"

    def reduce(self, flag, reduction):
        return flag


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/object_storage.md")
