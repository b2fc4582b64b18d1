"""`--output_mirror s3://bucket/run` (any fsspec URL): a copy of the run directory in object storage, so that a run
survives the loss of its machine and its disk.

Checkpoints are written on the local disk first, as without a mirror (atomic rename, src/checkpoint.py); then the
main process uploads each one with its `trainer_state.json` last. In the mirror, as on disk, only a checkpoint with
a trainer state is complete, so an upload cut off half-way is never taken for `latest`. `--resume_from_checkpoint
latest` downloads the mirror's newest complete checkpoint when the local disk has none as new (a fresh machine),
`--save_total_limit` rotates the mirror as it rotates the disk, and at the end model/, metrics.jsonl, config.yaml and
eval_results.json follow. The upload runs on the main process while the others wait at the barrier that ends each
checkpoint, so the checkpoint is safe in the mirror before training goes on. With --output_mirror_async it runs on a
thread of the main process instead, from a snapshot of hard links (the disk's rotation may remove the checkpoint
meanwhile), while training goes on; the next checkpoint waits for it, as do a preemption (its checkpoint is uploaded
before the run exits) and the end. One upload at a time, in order: the mirror sees the same sequence either way.

The storage library follows from the URL's protocol (s3fs for s3://: an optional extra, `pip install s3fs`, imported
only for such a URL), and so do the credentials: the library's own environment variables and config files
(AWS_ACCESS_KEY_ID, ~/.aws/credentials, AWS_ENDPOINT_URL, ...), never the run's config.
"""

import contextlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from src.checkpoint import TrainerState, all_processes_agree, checkpoint_dir, checkpoint_step, complete_checkpoints
from src.config import TrainConfig
from src.errors import CheckpointWriteFailed, UsageError, one_line
from src.features import options_of
from src.run_dir import (
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    EVAL_RESULTS_FILE,
    METRICS_FILE,
    MODEL_DIR,
    PREDICTIONS_FILE,
    STATE_FILE,
    TMP_PREFIX,
    continues_its_run,
    move_into_place,
)

if TYPE_CHECKING:
    import fsspec

logger = logging.getLogger(__name__)

OPTIONS = {"file": {"auto_mkdir": True}}  # a file:// mirror creates its folders as an object store needs none
# The start's check answers in seconds, not after botocore's default minute of retries; uploads keep the defaults.
CHECK_OPTIONS = {"s3": {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": {"max_attempts": 2}}}}
LIBRARIES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}
ROOT_FILES = (CONFIG_FILE, METRICS_FILE, EVAL_RESULTS_FILE, PREDICTIONS_FILE)  # the run root's files, not folders
PROBE = ".write_check"  # written and removed by the start's check


@dataclass
class MirrorOptions:
    output_mirror: str | None = None  # s3://bucket/run or any fsspec URL: a copy of checkpoints/, model/, metrics.jsonl
    output_mirror_async: bool = False  # upload each checkpoint on a thread as training goes on (docs/object_storage.md)

    def __post_init__(self):
        if self.output_mirror_async and not self.output_mirror:
            raise UsageError("--output_mirror_async uploads to --output_mirror: set it too (s3://bucket/run)")


def mirror_url(config: TrainConfig) -> str | None:
    return options_of(MirrorOptions, config.feature_args).output_mirror


@dataclass
class Mirror:
    """The mirror's file system and its root, the URL as that file system's path."""

    url: str
    fs: "fsspec.AbstractFileSystem"
    root: str

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def complete_steps(self) -> list[int]:
        """Oldest first: the checkpoints whose trainer state arrived, the last file each upload sends."""
        self.fs.invalidate_cache()
        markers = self.fs.glob(self.path(CHECKPOINTS_DIR, "step_*", STATE_FILE))
        return sorted(int(marker.rstrip("/").split("/")[-2].removeprefix("step_")) for marker in markers)

    def checkpoint_names(self) -> list[str]:
        """Every step_<N> folder in the mirror, complete or not."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.invalidate_cache()
            names = [entry.rstrip("/").split("/")[-1] for entry in self.fs.ls(self.path(CHECKPOINTS_DIR), detail=False)]
            return [name for name in names if name.startswith("step_")]
        return []

    def holds_run(self) -> bool:
        return bool(self.checkpoint_names()) or self.fs.exists(self.path(MODEL_DIR))

    def write_probe(self) -> None:
        """Write and remove a tiny object: credentials that may read but not write fail here, not at step 1000."""
        self.fs.pipe_file(self.path(PROBE), b"")
        with contextlib.suppress(FileNotFoundError):  # another process may have removed it already
            self.fs.rm_file(self.path(PROBE))

    def put(self, files: list[Path], local_root: Path, remote_root: str) -> None:
        """Upload `files` (under `local_root`) to the same places under `remote_root`, concurrently where the library
        can (s3fs)."""
        if files:
            remote = [f"{remote_root}/{file.relative_to(local_root).as_posix()}" for file in files]
            self.fs.put([str(file) for file in files], remote)

    def remove_checkpoint(self, name: str) -> None:
        """Its trainer state first: a removal cut off half-way leaves an incomplete checkpoint, never a broken one."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(CHECKPOINTS_DIR, name, STATE_FILE))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(CHECKPOINTS_DIR, name), recursive=True)


def mirror_of(config: TrainConfig, check: bool = False) -> Mirror | None:
    """The run's mirror, None without --output_mirror. `check`: a fresh client with the start's short timeouts."""
    if not mirror_url(config):
        return None
    import fsspec

    url = mirror_url(config)
    protocol = url.split("://", 1)[0]
    options = {**OPTIONS.get(protocol, {}), **(CHECK_OPTIONS.get(protocol, {}) if check else {})}
    fs, root = fsspec.core.url_to_fs(url, **options, **({"skip_instance_cache": True} if check else {}))
    return Mirror(url, fs, root)


def check_mirror(config: TrainConfig) -> None:
    """Before anything is read or written: the URL's library is installed, the bucket exists and is reachable, the
    credentials may list and write there, and the mirror holds no other run unless this run continues or replaces
    it. Every process checks (each would stop anyway); a failure is one line, exit 2, and nothing written. First, an
    upload on a thread that an earlier run in this process left (a notebook, a sweep) is waited for."""
    finish_earlier_upload()
    if not mirror_url(config):
        return
    url = mirror_url(config)
    if "://" not in url:
        raise UsageError(f"--output_mirror {url} is not a URL; use one like s3://bucket/run (or file:///path)")
    protocol = url.split("://", 1)[0]
    if protocol == "file" and not url.startswith("file:///"):  # file://tmp/run names the relative path tmp/run
        raise UsageError(f"--output_mirror {url} has no absolute path; use file:///absolute/path (three slashes)")
    try:
        mirror = mirror_of(config, check=True)
    except ImportError as err:
        library = LIBRARIES.get(protocol, f"the fsspec library for {protocol}://")
        raise UsageError(f"--output_mirror {url} needs {library}: pip install {library}") from err
    except ValueError as err:  # fsspec: "Protocol not known"
        raise UsageError(f"--output_mirror {url}: {one_line(err)}; use s3://, gs://, az:// or file://") from err
    holds_run = reach(url, mirror.holds_run)
    if holds_run and not (continues_its_run(config) or config.overwrite_output_dir):
        raise UsageError(
            f"--output_mirror {url} already holds a run (checkpoints/ or model/); continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir true, or choose another URL"
        )
    reach(url, mirror.write_probe)


def reach(url: str, call):
    """`call()`, its failure one UsageError line."""
    try:
        return call()
    except Exception as err:  # each library raises its own kinds: botocore's, aiohttp's, OSError, PermissionError
        raise UsageError(f"cannot use --output_mirror {url}: {storage_failure(err)}") from err


def storage_failure(err: Exception) -> str:
    """What went wrong, in the words a user acts on."""
    name = type(err).__name__
    message = one_line(err)[:300]
    if name == "NoCredentialsError" or isinstance(err, PermissionError):
        return (
            f"no credentials, or not allowed to write there ({name}: {message}); set them the way the storage "
            "library reads them (for S3: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or ~/.aws/credentials)"
        )
    if isinstance(err, FileNotFoundError):
        return f"no such bucket ({message}); create it first"
    return f"{name}: {message}; check the URL, the endpoint (AWS_ENDPOINT_URL for S3) and the network"


def fetch_checkpoint(accelerator, config: TrainConfig) -> None:
    """`--resume_from_checkpoint latest`: where the mirror's newest complete checkpoint is newer than the local
    disk's, the main process downloads it (under a temporary name, renamed when complete), the best model's
    checkpoint that it names (--load_best_model_at_end loads it at the end), and the mirror's metrics.jsonl, so the
    resumed run's log has every step."""
    mirror = mirror_of(config)
    if mirror is None or config.resume_from_checkpoint != "latest":
        return
    if accelerator.is_main_process:
        output_dir = Path(config.output_dir)
        local = [checkpoint_step(path) for path in complete_checkpoints(output_dir)]
        remote = mirror.complete_steps()
        if remote and remote[-1] > max(local, default=0):
            latest = download(mirror, remote[-1], output_dir)
            best = json.loads((latest / STATE_FILE).read_text()).get("best_model_step")
            if best in remote and best not in local and best != remote[-1]:
                download(mirror, best, output_dir)
            download_metrics(mirror, output_dir)
    accelerator.wait_for_everyone()


def download(mirror: Mirror, step: int, output_dir: Path) -> Path:
    final = checkpoint_dir(output_dir, step)
    partial = final.with_name(TMP_PREFIX + final.name)
    shutil.rmtree(partial, ignore_errors=True)
    source = mirror.path(CHECKPOINTS_DIR, final.name)
    remote = sorted(mirror.fs.find(source))
    local = [partial / path.removeprefix(source).lstrip("/") for path in remote]
    for path in local:
        path.parent.mkdir(parents=True, exist_ok=True)
    logger.info("downloading checkpoint %s from %s (%d files)", final.name, mirror.url, len(remote))
    mirror.fs.get(remote, [str(path) for path in local])
    move_into_place(partial, final)
    return final


def download_metrics(mirror: Mirror, output_dir: Path) -> None:
    """The log that goes with the checkpoint (uploaded before its trainer state); the resume truncates it."""
    metrics, partial = output_dir / METRICS_FILE, output_dir / (TMP_PREFIX + METRICS_FILE)
    with contextlib.suppress(FileNotFoundError):
        mirror.fs.get_file(mirror.path(METRICS_FILE), str(partial))
        os.replace(partial, metrics)


def prepare_mirror(accelerator, config: TrainConfig, resumed: bool) -> None:
    """A fresh start (check_mirror let it replace the mirror's run) empties the mirror of the previous run, as
    prepare_output_dir empties the local run directory; a resumed run keeps it."""
    mirror = mirror_of(config)
    if mirror is not None and not resumed and accelerator.is_main_process:
        for name in mirror.checkpoint_names():
            mirror.remove_checkpoint(name)
        for name in (MODEL_DIR, *ROOT_FILES):
            with contextlib.suppress(FileNotFoundError):
                mirror.fs.rm(mirror.path(name), recursive=True)
    accelerator.wait_for_everyone()


def upload_checkpoint(accelerator, config: TrainConfig, checkpoint: Path, state: TrainerState) -> None:
    """After save_checkpoint, on every process: the main one uploads `checkpoint`, metrics.jsonl and config.yaml,
    the trainer state last, then rotates the mirror (--save_total_limit; the best model's checkpoint kept). With
    --output_mirror_async it starts that on a thread once the previous upload is done, but for a preemption's
    checkpoint, uploaded now: the machine may be gone after the exit."""
    mirror = mirror_of(config)
    if mirror is None:
        return
    output_dir, keep, keep_step = Path(config.output_dir), config.save_total_limit, state.best_model_step

    def upload_now() -> None:
        try:
            wait_for_upload()
        except UploadFailed as err:  # a preemption's checkpoint, newer, still goes up: then the mirror lacks nothing
            logger.warning("%s; uploading checkpoint %s instead", err, checkpoint.name)
        upload(mirror, checkpoint, output_dir, keep, keep_step)

    def upload_on_a_thread() -> None:
        wait_for_upload()
        PENDING.append(Upload.start(mirror, checkpoint, output_dir, keep, keep_step))

    background = options_of(MirrorOptions, config.feature_args).output_mirror_async and not state.preempted
    on_main(accelerator, f"checkpoint {checkpoint.name}", config, upload_on_a_thread if background else upload_now)


@dataclass
class Upload:
    """A checkpoint on its way to the mirror on a thread (--output_mirror_async), from `snapshot`: hard links to its
    files (a checkpoint's files are written once, never changed) and copies of metrics.jsonl and config.yaml."""

    name: str
    url: str
    snapshot: Path
    thread: threading.Thread | None = None
    failure: BaseException | None = field(default=None, repr=False)

    @classmethod
    def start(cls, mirror: Mirror, checkpoint: Path, output_dir: Path, keep: int | None, keep_step: int | None):
        snapshot = checkpoint.parent / f"{TMP_PREFIX}upload_{checkpoint.name}"  # removed at a restart, if left
        try:
            shutil.rmtree(snapshot, ignore_errors=True)
            shutil.copytree(checkpoint, snapshot / checkpoint.name, copy_function=link_or_copy)
            for path in existing(output_dir, (METRICS_FILE, CONFIG_FILE)):
                shutil.copy2(path, snapshot / path.name)  # metrics.jsonl grows as training goes on
        except OSError as err:
            shutil.rmtree(snapshot, ignore_errors=True)
            raise UploadFailed(f"checkpoint {checkpoint.name}", err, local=True) from err
        pending = cls(checkpoint.name, mirror.url, snapshot)
        pending.thread = threading.Thread(
            target=pending.run, args=(mirror, keep, keep_step), name=f"upload {checkpoint.name}"
        )  # not a daemon: the exit of a run stopped early (an error, Ctrl-C) waits for it
        pending.thread.start()
        return pending

    def run(self, mirror: Mirror, keep: int | None, keep_step: int | None) -> None:
        try:
            upload(mirror, self.snapshot / self.name, self.snapshot, keep, keep_step)
        except BaseException as err:  # the storage library's own kinds; raised where the run next waits
            self.failure = err
            logger.error("could not upload checkpoint %s to %s: %s", self.name, self.url, storage_failure(err))
        finally:
            shutil.rmtree(self.snapshot, ignore_errors=True)


PENDING: list[Upload] = []  # the upload on a thread, if any: one at a time in a process


def link_or_copy(source: str, destination: str) -> None:
    """A hard link, no byte copied; a copy where the file system has none (the disk holds it twice meanwhile)."""
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


class UploadFailed(Exception):
    """An upload on a thread failed (or its snapshot could not be made: `local`), raised where the run waits for it,
    naming what it was uploading."""

    def __init__(self, what: str, cause: BaseException, local: bool = False):
        super().__init__(f"could not upload {what} ({type(cause).__name__}: {one_line(cause)})")
        self.what, self.cause, self.local = what, cause, local


def wait_for_upload() -> None:
    """Until the upload on a thread, if any, is done; its failure raised as an UploadFailed."""
    while PENDING:
        pending = PENDING.pop()
        pending.thread.join()
        if pending.failure is not None:
            raise UploadFailed(f"checkpoint {pending.name}", pending.failure)


def finish_earlier_upload() -> None:
    """An earlier run's upload on a thread (a run in this process that stopped early) finished before this run
    touches its directories; its failure was logged as it happened."""
    if PENDING:
        logger.info("waiting for the upload of checkpoint %s from an earlier run", PENDING[-1].name)
    with contextlib.suppress(UploadFailed):
        wait_for_upload()


def on_main(accelerator, what: str, config: TrainConfig, call) -> None:
    """`call()` on the main process while the others wait; a failure stops every process (exit 74) with one line:
    the local run directory is intact."""
    failure, reason = None, "an upload on the main process failed (its error line names it)"
    if accelerator.is_main_process:
        try:
            call()
        except UploadFailed as err:  # an earlier upload's, on a thread, or a snapshot's on the local disk
            what, failure = err.what, err.cause
            reason = f"{type(failure).__name__}: {one_line(failure)}" if err.local else storage_failure(failure)
        except Exception as err:  # the storage library's own kinds
            failure, reason = err, storage_failure(err)
    if not all_processes_agree(accelerator, failure is None):
        if failure is None:  # another process: the main one says which upload and why
            raise CheckpointWriteFailed(f"{reason}; the local run directory is intact")
        raise CheckpointWriteFailed(
            f"could not upload {what} to {mirror_url(config)} ({reason}); the local run directory is intact: "
            "resume with --resume_from_checkpoint latest"
        )
    accelerator.wait_for_everyone()


def upload(mirror: Mirror, checkpoint: Path, run_root: Path, keep: int | None, keep_step: int | None) -> None:
    """`checkpoint`, then run_root's metrics.jsonl and config.yaml, then the checkpoint's trainer state; then the
    mirror rotated to `keep` checkpoints (and `keep_step`'s)."""
    complete = {f"step_{step}" for step in mirror.complete_steps()}
    for name in mirror.checkpoint_names():  # incomplete ones from an upload cut off, and this step's older copy
        if name == checkpoint.name or name not in complete:
            mirror.remove_checkpoint(name)
    files = sorted(path for path in checkpoint.rglob("*") if path.is_file() and path.name != STATE_FILE)
    remote = mirror.path(CHECKPOINTS_DIR, checkpoint.name)
    mirror.put(files, checkpoint, remote)
    mirror.put(existing(run_root, (METRICS_FILE, CONFIG_FILE)), run_root, mirror.root)  # before the marker
    mirror.put([checkpoint / STATE_FILE], checkpoint, remote)  # last: now the checkpoint is complete
    rotate(mirror, keep, keep_step)
    logger.info("checkpoint %s uploaded to %s", checkpoint.name, mirror.url)


def rotate(mirror: Mirror, keep: int | None, keep_step: int | None) -> None:
    """As src/checkpoint.py's rotate_checkpoints, in the mirror."""
    if keep:
        for step in mirror.complete_steps()[:-keep]:
            if step != keep_step:
                mirror.remove_checkpoint(f"step_{step}")


def upload_run(accelerator, config: TrainConfig) -> None:
    """At the end of training: model/ and the run root's files (metrics.jsonl, config.yaml, eval_results.json,
    predictions.jsonl) to the mirror, from the main process."""
    mirror = mirror_of(config)
    if mirror is None:
        return

    def upload_last() -> None:
        wait_for_upload()  # the last checkpoint's, on a thread with --output_mirror_async
        upload_final(mirror, Path(config.output_dir))

    on_main(accelerator, "model/ and metrics.jsonl", config, upload_last)


def upload_final(mirror: Mirror, output_dir: Path) -> None:
    model = output_dir / MODEL_DIR
    mirror.put(sorted(p for p in model.rglob("*") if p.is_file()), model, mirror.path(MODEL_DIR))
    mirror.put(existing(output_dir, ROOT_FILES), output_dir, mirror.root)
    logger.info("model/ and %s uploaded to %s", ", ".join(p.name for p in existing(output_dir, ROOT_FILES)), mirror.url)


def existing(folder: Path, names: tuple[str, ...]) -> list[Path]:
    return [folder / name for name in names if (folder / name).is_file()]
