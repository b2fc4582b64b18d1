"""The final model: `output_dir/model/` in the task's format, written from every process's shards, and read back."""

import shutil
from dataclasses import replace
from pathlib import Path

import yaml
from accelerate.utils import load_checkpoint_in_model
from accelerate.utils.memory import should_reduce_batch_size
from safetensors import SafetensorError

from src.checkpoint import all_processes_agree, write_failed
from src.config import TrainConfig
from src.errors import UsageError, one_line
from src.run_dir import CONFIG_FILE, MODEL_DIR, STATE_FILE, TMP_PREFIX, move_into_place


def save_final_model(accelerator, task, model, output_dir: Path) -> Path:
    """model/ written beside it by every process (sharded models are gathered), then renamed into place: a kill while
    saving leaves the previous model/ whole; a failed write stops every process in one line, as a checkpoint's."""
    final = output_dir / MODEL_DIR
    partial = final.with_name(TMP_PREFIX + MODEL_DIR)  # a stopped run's: removed at the next start (src/run_dir.py)
    failure = None
    try:
        task.save_model(accelerator, model, partial)
    except (OSError, RuntimeError, SafetensorError) as err:  # a full disk: Python's, torch.save's, safetensors' error
        if should_reduce_batch_size(err):  # out of memory gathering a sharded model: no write failed
            raise
        failure = err  # a task's own bug (another kind) is its one line, not a write's
    if not all_processes_agree(accelerator, failure is None):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        advice = "the checkpoints are intact. Free disk space and resume with --resume_from_checkpoint latest"
        raise write_failed(failure, str(final), advice + ": it trains no further and writes the model again")
    if accelerator.is_main_process:
        move_into_place(partial, final)
    accelerator.wait_for_everyone()
    return final


def load_weights(model, path: str):
    """A saved model's or checkpoint's weights into `model`, returned; strict: every parameter there, with its shape."""
    folder = saved_model_dir(path)
    try:
        load_checkpoint_in_model(model, str(folder), strict=True)
    except Exception as err:  # torch's, safetensors' (a damaged file) and accelerate's own kinds
        raise UsageError(
            f"--model_name_or_path {path} does not hold weights for this model, or is damaged "
            f"(same --task and options as when it was trained?): {type(err).__name__}: {one_line(err)[:300]}"
        ) from err
    return model


def saved_model_dir(path: str) -> Path:
    """A run's model/ folder as given; a run's output_dir -> its model/; a checkpoint -> its exported model/ if any."""
    folder = Path(path)
    if not folder.is_dir():
        if folder.name == MODEL_DIR:  # e.g. --do_train false's default: the run's own model/
            raise UsageError(
                f"{folder.parent} has no {MODEL_DIR}/ to evaluate (no run finished there): train there first, or name "
                "a model with --model_name_or_path (a run's model/ or checkpoints/step_<N>/)"
            )
        raise UsageError(f"--model_name_or_path {path}: no such folder (a run's model/ or checkpoints/step_<N>/)")
    if (folder / MODEL_DIR).is_dir() and ((folder / STATE_FILE).is_file() or (folder / CONFIG_FILE).is_file()):
        return folder / MODEL_DIR
    return folder


def model_to_evaluate(config: TrainConfig) -> TrainConfig:
    """`--do_train false` into a trained run's folder evaluates its model/, also where its config.yaml names the start
    model, and writes a checkpoint's results into the checkpoint's folder; any other model is refused there, so the
    run's eval_results.json and predictions stay its own."""
    run, model = Path(config.output_dir), config.model_name_or_path
    inside = Path(model).resolve().is_relative_to(run.resolve())
    if inside and (Path(model) / STATE_FILE).is_file():  # a checkpoint of the run: its results beside its weights,
        return replace(config, output_dir=model)  # not over the run's final eval_results.json
    if not (run / MODEL_DIR).is_dir() or inside:
        return config  # a fresh folder, or this run's model/, a checkpoint of it, or the run folder itself
    run_config = run / CONFIG_FILE
    started_from = yaml.safe_load(run_config.read_text()).get("model_name_or_path") if run_config.is_file() else None
    if started_from is not None and Path(model).resolve() == Path(started_from).resolve():  # a Hub name: as written
        return replace(config, model_name_or_path=str(run / MODEL_DIR))
    raise UsageError(
        f"--output_dir {run} holds a trained run: evaluating --model_name_or_path {model} there would replace its "
        f"results; evaluate the run's own model with --model_name_or_path {run}, or choose another --output_dir"
    )
