"""--task image_classification on an image folder (docs/images.md's commands): the same training on 1 and 2
processes with augmentation on and loader workers, a kill + resume equal to the uninterrupted run, every eval image
counted once, a transformers model's model/ that the image-classification pipeline reloads with the run's accuracy
(where the hf feature is), and a folder without class subfolders refused. The augmentation rule itself
(docs/customize.md's recipe) is checked without training."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader, Subset

from scripts.readme_commands import section_commands
from src.batches import EpochDependent, LoaderBatches
from src.cli import parse_config
from src.errors import EXIT_TASK_FAILED, UsageError
from src.features.images.image_classification import Augmentation, ImageSamples, Preprocess, sample_generator
from src.tasks import build_task
from tests.conftest import (
    REPO,
    assert_ok,
    assert_processes,
    last_row,
    read_metrics,
    run_command,
    run_main,
    run_with_hook,
    series,
    signal_at,
)
from tests.helpers import (
    as_written,
    assert_bash_blocks_run,
    assert_error_line,
    docs_code_block,
    has_feature,
    needs,
    printed_by,
    train_losses,
    workspace,
)

# 128 train images in global batches of 32: 4 steps an epoch, so 12 steps cross two epoch boundaries
SHORT = ["--max_steps", "12", "--max_train_samples", "128", "--global_batch_size", "32",
         "--per_device_train_batch_size", "16", "--logging_steps", "1", "--eval_steps", "1000"]  # fmt: skip


# --- the augmentation rule, without training ---


def test_augmentation_depends_only_on_seed_epoch_and_index():
    image = torch.arange(3 * 8 * 8, dtype=torch.float32).view(3, 8, 8)
    augment = Augmentation(crop_padding=2, horizontal_flip=True)

    def draw(seed, epoch, index):
        return augment(image, sample_generator(seed, epoch, index))

    assert draw(0, 1, 5).shape == image.shape
    assert torch.equal(draw(0, 1, 5), draw(0, 1, 5))  # wherever and whenever it is drawn
    variants = [draw(0, epoch, 5) for epoch in range(6)]
    assert len({tuple(v.flatten().tolist()) for v in variants}) > 1  # another epoch, other crops
    assert any(not torch.equal(draw(0, 1, 5), draw(0, 1, i)) for i in range(6, 12))  # and per sample
    assert any(not torch.equal(draw(0, 1, 5), draw(seed, 1, 5)) for seed in range(1, 7))  # and per seed
    assert torch.equal(Augmentation()(image, sample_generator(0, 0, 0)), image)  # off: the image as it is


class NoOpEpochLoader(DataLoader):
    """A DataLoader with the prepared loader's set_epoch that does nothing: only the loop's own call sets it."""

    def set_epoch(self, epoch: int) -> None:
        pass


def test_the_loop_sets_the_epoch_in_the_loader_workers():
    """docs/customize.md's recipe, verbatim, through LoaderBatches with 2 workers (each copies the dataset when an
    epoch's iterator starts) and under --max_train_samples' Subset: each epoch's samples are those the epoch's seed
    gives, and the same again when an epoch is read a second time (a resume)."""
    namespace = {}
    exec(docs_code_block("docs/customize.md", "# a train dataset whose random draws are the same"), namespace)
    inputs, labels = torch.zeros(6, 2), torch.arange(6)
    noisy = namespace["Noisy"](inputs, labels, seed=3)
    assert isinstance(noisy, EpochDependent)
    loader = NoOpEpochLoader(Subset(noisy, range(4)), batch_size=2, num_workers=2)
    source = LoaderBatches(accelerator=None, loader=loader)

    def epoch(number):
        return torch.cat([batch[0] for batch in source.epoch(number)])

    def expected(number):
        return torch.stack([0.1 * torch.randn(2, generator=sample_generator(3, number, i)) for i in range(4)])

    torch.testing.assert_close(epoch(2), expected(2), rtol=0, atol=0)
    torch.testing.assert_close(epoch(0), expected(0), rtol=0, atol=0)
    torch.testing.assert_close(epoch(2), expected(2), rtol=0, atol=0)
    assert not torch.equal(expected(0), expected(2))


def test_image_samples_are_preprocessed_and_augmented_per_index():
    """ImageSamples: RGB in [-1, 1], labelled or not; augmented by its epoch and index, the eval split never."""
    images = [{"image": Image.new("L", (8, 8), color=255 * (i % 2))} for i in range(4)]
    augment = Augmentation(crop_padding=1)
    train = ImageSamples(images, "image", Preprocess(), torch.arange(4), augment, seed=0)
    plain = ImageSamples(images, "image", Preprocess())
    (pixels,) = plain[1]
    assert pixels.shape == (3, 8, 8) and torch.equal(pixels, torch.ones(3, 8, 8))
    train.set_epoch(4)
    augmented, label = train[2]
    assert label == 2 and torch.equal(augmented, augment(plain[2][0], sample_generator(0, 4, 2)))


# --- docs/images.md, run ---


# docs/images.md's commands by their second word; the ViT's (a transformers model) only where the hf feature is
CNN_COMMANDS = ["scripts/make_image_folder.py", "launch"]
VIT_COMMANDS = ["scripts/make_tiny_model.py", "train.py", "-c"]


@pytest.fixture(scope="module")
def docs(tmp_path_factory) -> dict:
    """docs/images.md's commands, and the one that makes the image folder run as written in a workspace."""
    commands = {c.split()[1]: c for c in section_commands("Image classification", page="docs/images.md")}
    assert sorted(commands) == sorted(CNN_COMMANDS + (VIT_COMMANDS if has_feature("hf") else []))
    cwd = workspace(tmp_path_factory.mktemp("images"))
    assert_ok(run_command(as_written(commands["scripts/make_image_folder.py"]), cwd=cwd))
    return {"cwd": cwd, "commands": commands}


def one_process(command: str) -> list[str]:
    """The docs' accelerate launch as `python train.py` with the same arguments."""
    words = as_written(command)
    return [sys.executable, *words[words.index("train.py") :]]


@pytest.fixture(scope="module")
def cnn_runs(docs, tmp_path_factory) -> dict:
    """The CNN command (shortened, flips added) on 2 processes with 2 loader workers each, on 1 process without
    workers, and on 1 process without augmentation (the two 1-process runs in this process, reading the same folders
    by their absolute paths)."""
    cwd, command = docs["cwd"], docs["commands"]["launch"]
    flags = [*SHORT, "--horizontal_flip", "true"]
    images = cwd / "data" / "digit_images"
    folders = ["--data_files", f"{{train: {images / 'train'}, eval: {images / 'eval'}}}"]
    runs = {name: tmp_path_factory.mktemp(f"cnn{name}") / "run" for name in (2, 1, "plain")}
    launch = [*as_written(command), *flags, "--dataloader_num_workers", "2", "--output_dir", str(runs[2])]
    assert_ok(run_command(launch, cwd=cwd))
    one = [*one_process(command)[2:], *flags, *folders]
    assert_ok(run_main(*one, "--output_dir", str(runs[1])))
    plain = ["--random_crop_padding", "0", "--horizontal_flip", "false", "--output_dir", str(runs["plain"])]
    assert_ok(run_main(*one, *plain))
    for name, run in runs.items():
        assert_processes(run, 2 if name == 2 else 1)
    return runs


def losses(run: Path) -> torch.Tensor:
    return torch.tensor(list(series(read_metrics(run), "train/loss").values()))


@pytest.mark.slow
def test_augmented_images_train_the_same_on_1_and_2_processes_with_workers(cnn_runs):
    one, two, plain = (losses(cnn_runs[name]) for name in (1, 2, "plain"))
    assert len(one) == 12
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5)
    assert (one - plain).abs().min() > 1e-4  # the augmentation really ran: without it every step's loss differs
    final = [last_row(read_metrics(cnn_runs[n])) for n in (1, 2)]
    assert final[1]["eval/loss"] == pytest.approx(final[0]["eval/loss"], abs=1e-5)
    assert final[1]["eval/accuracy"] == final[0]["eval/accuracy"]


@pytest.mark.slow
def test_every_eval_image_is_counted_once_on_2_processes(cnn_runs, docs):
    images = len(list((docs["cwd"] / "data" / "digit_images" / "eval").glob("*/*.png")))
    assert images == 359  # a prime: 2 processes shard it unevenly
    assert last_row(read_metrics(cnn_runs[2]))["eval/num_samples"] == images


@pytest.mark.slow
def test_killed_and_resumed_run_matches_the_uninterrupted_one(cnn_runs, docs, tmp_path):
    """Killed at step 8, resumed from step_6 (epoch 1, two batches in), with 2 loader workers and the folder read
    through --dataset_name imagefolder: the per-step losses are those of the uninterrupted run."""
    out, cwd = tmp_path / "run", docs["cwd"]
    folders = "{train: data/digit_images/train, eval: data/digit_images/eval}"
    args = [*one_process(docs["commands"]["launch"])[2:], *SHORT, "--horizontal_flip", "true", "--output_dir", str(out),
            "--save_steps", "6", "--resume_from_checkpoint", "latest", "--dataloader_num_workers", "2",
            "--dataset_name", "imagefolder", "--data_files", folders]  # fmt: skip
    killed = run_with_hook(tmp_path, args, signal_at(8), cwd=cwd)
    assert killed.returncode != 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_6"]
    resumed = run_main(*args, cwd=cwd)  # the same command, in this process (its loader workers forked from it)
    assert_ok(resumed)
    assert "resuming from" in resumed.stdout + resumed.stderr
    resumed_losses, _ = train_losses(out)
    expected, _ = train_losses(cnn_runs[1])
    assert list(resumed_losses) == list(range(1, 13))
    assert max(abs(resumed_losses[step] - expected[step]) for step in expected) <= 1e-6


def classify_with_a_pipeline(model_dir: Path, folder: Path) -> dict:
    """transformers' image-classification pipeline from the saved model over every image of `folder`: its accuracy
    against the class folders, and each file's label."""
    from transformers import pipeline

    files = sorted(folder.glob("*/*.png"))
    classify = pipeline("image-classification", model=str(model_dir))
    labels = [result[0]["label"] for result in classify([str(f) for f in files], top_k=1)]
    return {"accuracy": sum(label == f.parent.name for label, f in zip(labels, files, strict=True)) / len(files),
            "labels": {str(f.relative_to(folder)): label for f, label in zip(files, labels, strict=True)}}  # fmt: skip


@pytest.mark.slow
@needs("hf")
def test_vit_model_reloads_in_a_pipeline_with_the_runs_accuracy_and_predictions(docs):
    """The commands that make the tiny ViT (as written) and train it (shortened), and the pipeline command as written;
    then the pipeline over the whole eval folder gives the run's eval/accuracy and, file by file, the classes of
    predictions.jsonl."""
    cwd, commands = docs["cwd"], docs["commands"]
    assert_ok(run_command(as_written(commands["scripts/make_tiny_model.py"]), cwd=cwd))
    vit = as_written(commands["train.py"])
    assert vit[1] == "train.py"  # `python train.py`: its main in this process, in the docs' folder
    assert_ok(run_main(*vit[2:], "--max_steps", "40", "--logging_steps", "10", cwd=cwd))
    run = cwd / "runs" / "vit"
    saved = {path.name for path in (run / "model").iterdir()}
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= saved
    config = json.loads((run / "model" / "config.json").read_text())
    names = ["eight", "five", "four", "nine", "one", "seven", "six", "three", "two", "zero"]  # sorted folder names
    assert [config["id2label"][str(i)] for i in range(10)] == names

    printed = printed_by(commands["-c"], cwd)  # in this process: this test imports transformers anyway
    assert "'label': '" in printed and any(f"'{name}'" in printed for name in names)

    reloaded = classify_with_a_pipeline(run / "model", cwd / "data" / "digit_images" / "eval")
    final = last_row(read_metrics(run))
    assert final["eval/num_samples"] == 359
    assert reloaded["accuracy"] == final["eval/accuracy"]
    predictions = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
    assert {row["id"]: row["prediction"] for row in predictions} == reloaded["labels"]
    assert final["eval/accuracy"] > 0.15  # above chance (0.1): it trained


@pytest.mark.slow
def test_a_folder_without_class_subfolders_is_one_line_and_exit_2(docs, tmp_path):
    flat = tmp_path / "flat"
    for split in ("train", "eval"):
        (flat / split).mkdir(parents=True)
        for i, png in enumerate(sorted((docs["cwd"] / "data" / "digit_images" / split).glob("*/*.png"))[:40]):
            shutil.copy(png, flat / split / f"{i}.png")
    out = tmp_path / "run"
    folders = f"{{train: {flat / 'train'}, eval: {flat / 'eval'}}}"
    result = run_main(*one_process(docs["commands"]["launch"])[2:], "--data_files", folders, "--output_dir", str(out))
    assert_error_line(result, rf"the train folder {flat / 'train'} has no class subfolders .*<class>/\*\.png")
    assert not out.exists()


WITHOUT_PILLOW = [
    ["scripts/make_image_folder.py", "--out", "{tmp}/images"],
    ["train.py", "--task", "image_classification", "--output_dir", "{tmp}/run"],
]


@pytest.mark.parametrize("command", WITHOUT_PILLOW)
def test_without_pillow_each_entry_point_names_what_to_install(tmp_path, command):
    """The Quickstart installs the core's requirements only: no Pillow (requirements/images.txt) until the images
    feature's own file is installed. Each entry point says so in one line, exit 2, writing nothing."""
    argv = [arg.format(tmp=tmp_path) for arg in command]
    without_pillow = f"import runpy, sys; sys.modules['PIL'] = None; sys.argv = {argv!r}; " + (
        f"runpy.run_path({argv[0]!r}, run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", without_pillow], cwd=REPO, capture_output=True, text=True,
                            timeout=120)  # fmt: skip
    assert_error_line(result, r"needs Pillow: pip install -r requirements/images\.txt$")
    assert not any(tmp_path.iterdir())


def test_a_split_the_folders_lack_is_the_one_line_that_names_its_flag(docs, tmp_path):
    out = tmp_path / "run"
    result = run_main(*one_process(docs["commands"]["launch"])[2:], "--eval_split", "nosuch", "--output_dir", str(out),
                      cwd=docs["cwd"])  # fmt: skip
    assert_error_line(result, r"no split 'nosuch' \(it has train, eval\); add it to --data_files or set --eval_split")
    assert not out.exists()


def test_a_missing_image_path_is_one_line(docs, tmp_path):
    """Files with an image column: a blank path is one line naming the column and split, not the decoder's traceback."""
    pngs = sorted((docs["cwd"] / "data" / "digit_images" / "train").glob("*/*.png"))[:4]
    rows = "image,label\n" + "".join(f"{png},{png.parent.name}\n" for png in pngs)
    (tmp_path / "eval.csv").write_text(rows)
    (tmp_path / "train.csv").write_text(rows + ",3\n")
    out, files = tmp_path / "run", f"{{train: {tmp_path / 'train.csv'}, eval: {tmp_path / 'eval.csv'}}}"
    result = run_main("--task", "image_classification", "--data_files", files, "--output_dir", str(out))
    assert_error_line(result, r"column 'image' has a missing value in the train split; fill them or drop the rows")
    assert not out.exists()


def test_without_the_hf_feature_a_model_folder_not_there_is_said_to_be_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "src.features.hf", None)  # as in a project made without hf: not importable
    run = tmp_path / "run"  # predicting before training: the run's model/ is not there
    config = parse_config(["--task", "image_classification", "--do_train", "false", "--output_dir", str(run)])
    with pytest.raises(UsageError, match=rf"^--model_name_or_path {run}/model: no such model folder \(a Hub model"):
        build_task(config)


@pytest.mark.parametrize("flag", [["--dropout", "0.1"], ["--config_overrides", "num_hidden_layers=2"]])
def test_a_transformers_models_option_given_to_the_plain_cnn_is_refused(flag):
    """Not ignored: the plain CNN has no dropout or config to override (nor has a project without the hf feature)."""
    config = parse_config(["--task", "image_classification", *flag])
    with pytest.raises(UsageError, match=rf"^{flag[0]} is a transformers model's \(--model_name_or_path\); the plain"):
        build_task(config)


def test_every_command_of_the_page_is_run():
    assert_bash_blocks_run("docs/images.md")


def test_the_default_folder_not_written_yet_is_one_line_naming_the_script(tmp_path):
    out = tmp_path / "run"
    result = run_main("--task", "image_classification", "--output_dir", str(out), cwd=tmp_path)
    assert_error_line(result, r"the image folder data/digit_images/train is not in .*scripts/make_image_folder.py")
    assert not out.exists()


# --- images that don't read or batch, and a test folder without classes: one line, or only predicted ---

COLOURS = {"blue": (0, 0, 255), "green": (0, 255, 0), "red": (255, 0, 0)}
# 30 images, 10 a step: every step of an epoch reads each once (the last is red/9.png, past the first batch's 10)
TINY = ["--task", "image_classification", "--per_device_train_batch_size", "10", "--global_batch_size", "10",
        "--max_steps", "3", "--eval_steps", "1000", "--dataloader_num_workers", "1"]  # fmt: skip


def colour_folders(root: Path, odd: str | None = None) -> dict[str, Path]:
    """train/ and eval/ of 10 8x8 images a colour; `odd`: red/9.png in train corrupt, or 12x10 ("size")."""
    for split in ("train", "eval"):
        for name, rgb in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            for i in range(10):
                Image.new("RGB", (8, 8), rgb).save(root / split / name / f"{i}.png")
    if odd == "corrupt":
        (root / "train" / "red" / "9.png").write_bytes(b"not a png at all")
    elif odd == "size":
        Image.new("RGB", (12, 10), COLOURS["red"]).save(root / "train" / "red" / "9.png")
    return {split: root / split for split in ("train", "eval")}


@pytest.mark.parametrize(
    "odd, line",
    [("corrupt", r"reading a batch failed: .*UnidentifiedImageError: cannot identify image file .*red/9\.png"),
     ("size", r"reading a batch failed: ValueError: the images differ in size: 8x8 and 12x10 \(.*red/9\.png\); set "
              r"--image_size N to resize each to N x N")],
)  # fmt: skip
def test_an_image_that_does_not_read_or_batch_is_one_line_from_a_loader_worker(tmp_path, odd, line):
    folders = colour_folders(tmp_path / "images", odd)
    files = f"{{train: {folders['train']}, eval: {folders['eval']}}}"
    result = run_main(*TINY, "--data_files", files, "--output_dir", str(tmp_path / "run"))
    assert_error_line(result, line, exit_code=EXIT_TASK_FAILED)


def test_an_unlabelled_test_folder_beside_training_is_predicted_not_scored(tmp_path):
    folders = colour_folders(tmp_path / "images")
    shutil.copytree(folders["eval"] / "green", unlabelled := tmp_path / "images" / "new")
    files = f"{{train: {folders['train']}, eval: {folders['eval']}, test: {unlabelled}}}"
    out = tmp_path / "run"
    result = run_main(*TINY, "--data_files", files, "--do_predict", "true", "--output_dir", str(out))
    assert_ok(result)
    assert (
        f"no test/ metrics: the test folder {unlabelled} has no class subfolders to label its images by"
        in result.stderr
    )
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted(row["id"] for row in rows) == [f"{i}.png" for i in range(10)]
