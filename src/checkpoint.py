"""The run directory: refuse to clobber a previous run, write the resolved config, save the final model."""

import shutil
from pathlib import Path

from src.config import TrainConfig, save_config
from src.errors import UsageError

# What a run writes into output_dir; --overwrite_output_dir removes exactly these, nothing else of the user's.
RUN_ARTIFACTS = ("metrics.jsonl", "config.yaml", "checkpoints", "model", "wandb")


def prepare_output_dir(accelerator, config: TrainConfig) -> Path:
    """Every process checks, then the main process writes: a refused run leaves no process behind or file changed."""
    output_dir = Path(config.output_dir)
    artifacts = [*RUN_ARTIFACTS, config.project_name]  # tensorboard logs go to output_dir/project_name
    previous = [name for name in artifacts if (output_dir / name).exists()]
    if previous and not config.overwrite_output_dir:
        raise UsageError(
            f"{output_dir} already holds a run ({', '.join(previous)}); pass --overwrite_output_dir to replace it "
            "or choose another --output_dir"
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for name in previous:
            path = output_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        output_dir.mkdir(parents=True, exist_ok=True)
        save_config(config, output_dir / "config.yaml")
    accelerator.wait_for_everyone()
    return output_dir


def save_final_model(accelerator, model, output_dir: Path) -> Path:
    """Weights as safetensors, gathered from every process (FSDP/DeepSpeed shards included)."""
    model_dir = output_dir / "model"
    accelerator.save_model(model, model_dir, safe_serialization=True)
    return model_dir
