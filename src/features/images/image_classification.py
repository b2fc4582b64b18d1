"""Classify images: `--task image_classification`, on folders of class subfolders or image + label columns.

    python scripts/make_image_folder.py                        # data/digit_images/{train,eval}/<class>/*.png
    python train.py --task image_classification --random_crop_padding 1                # the plain CNN
    python train.py --task image_classification --model_name_or_path data/tiny/vit    # a transformers model (hf)

Data: a folder per split, `--data_files '{train: my/train, eval: my/eval}'`, read by `datasets`' imagefolder builder
(each class a subfolder; the subfolders' names are the label names), or files with an image column (paths or
bytes) and a label column. The model: `AutoModelForImageClassification` with its `AutoImageProcessor` when
`--model_name_or_path` names a transformers model (a folder with config.json, or a Hub name), else the plain CNN of
src/models/digits_cnn.py. Each image is decoded and preprocessed as the `image-classification` pipeline does (RGB,
then the image processor), so `model/` classifies in a pipeline exactly as it was evaluated here; the label names are
saved with it (`id2label` / `label2id`; labels.json beside the plain CNN's weights). Random crops and flips augment
the train split, drawn from each sample's own generator (`Augmentation`: the same on 1 or N processes, with any number
of loader workers, and after a resume).
"""

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from src.data import MissingColumns, check_columns, check_complete, load_splits, reads_local_files
from src.errors import UsageError
from src.final_model import saved_model_dir
from src.models.digits_cnn import DigitsCNN
from src.tasks.classification import LABELS_FILE, ClassificationTask, label_maps, save_labels, saved_labels


@dataclass(frozen=True)
class Augmentation:
    """Random crops and horizontal flips of a (C, H, W) image, drawn from a generator of that sample's own.

    Not torch's global RNG: what it has drawn before a sample depends on how many processes share the data (each
    draws for its own shard), on the loader's workers (each has an RNG of its own) and on where a resumed run
    started, so the same sample would be augmented differently on 1 and N processes, with workers, and after a
    resume. A generator seeded by (seed, epoch, sample index) gives a sample the same draws wherever and whenever it
    is loaded, and other draws in the next epoch."""

    crop_padding: int = 0  # pad by this many pixels (the edge repeated), cut a window of the image's size from it
    horizontal_flip: bool = False  # mirror left-right with probability 1/2

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.horizontal_flip

    def __call__(self, image: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        if self.crop_padding:
            pad, (height, width) = self.crop_padding, image.shape[-2:]
            top, left = torch.randint(0, 2 * pad + 1, (2,), generator=generator).tolist()
            padded = F.pad(image[None], (pad, pad, pad, pad), mode="replicate")[0]
            image = padded[:, top : top + height, left : left + width]
        if self.horizontal_flip and torch.rand((), generator=generator) < 0.5:
            image = image.flip(-1)
        return image


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator whose draws depend on (seed, epoch, index) only; numpy's SeedSequence mixes the three into one
    seed, so neighbouring indices or epochs get unrelated streams."""
    state = np.random.SeedSequence([seed % 2**64, epoch, index]).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


class Preprocess:
    """A decoded image -> the model's (C, H, W) float input, as the image-classification pipeline makes it: the
    EXIF orientation applied, RGB, then the image processor. Without one (the plain CNN): resized to `image_size` if
    set, pixels scaled to [-1, 1]."""

    def __init__(self, processor=None, image_size: int | None = None):
        self.processor, self.image_size = processor, image_size
        self.size_seen = None  # without image_size: the first image's, which every other must have to batch

    def __call__(self, image) -> torch.Tensor:
        from PIL import Image, ImageOps

        name = getattr(image, "filename", "") or "an image"  # a decoded file's path (not a transposed copy's)
        image = ImageOps.exif_transpose(image).convert("RGB")
        if self.processor is not None:
            return self.processor(image, return_tensors="pt")["pixel_values"][0]
        if self.image_size:
            image = image.resize((self.image_size, self.image_size), Image.Resampling.BILINEAR)
        elif self.size_seen is None:
            self.size_seen = image.size
        elif image.size != self.size_seen:
            sizes = " and ".join("x".join(map(str, size)) for size in (self.size_seen, image.size))
            raise ValueError(f"the images differ in size: {sizes} ({name}); set --image_size N to resize each to N x N")
        return torch.from_numpy(np.array(image)).permute(2, 0, 1).float().div(127.5).sub(1.0)


class ImageSamples(Dataset):
    """One split's images, decoded and preprocessed per sample (a loader's workers do it in parallel): (pixels,
    label) or (pixels,) unlabelled. With an augmentation its draws depend on the epoch that `set_epoch` sets
    (src/batches.py's `EpochDependent`: the loop sets it before each epoch, a resumed run the epoch it resumes in)."""

    def __init__(self, split, column: str, preprocess: Preprocess, labels=None, augmentation=None, seed: int = 0):
        self.split, self.column, self.preprocess, self.labels = split, column, preprocess, labels
        self.augmentation, self.seed, self.epoch = augmentation, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, index: int):
        pixels = self.preprocess(self.split[index][self.column])
        if self.augmentation is not None:
            pixels = self.augmentation(pixels, sample_generator(self.seed, self.epoch, index))
        return (pixels,) if self.labels is None else (pixels, self.labels[index])


def is_transformers_model(name: str | None) -> bool:
    """A folder with config.json (a run's output_dir or checkpoint: its model/), or a Hub name; not the plain CNN's
    model/ (model.safetensors and labels.json) or a folder without a model."""
    if not name:
        return False
    return not Path(name).is_dir() or (saved_model_dir(name) / "config.json").is_file()


class ImageClassification(ClassificationTask):
    @dataclass
    class Options:
        image_column: str = "image"  # images: imagefolder's decoded images, or image file paths or bytes
        label_column: str = "label"  # an image folder's class subfolder names, or the column's integers or strings
        random_crop_padding: int = 0  # train augmentation: pad by N pixels, crop back to the size at a random place
        horizontal_flip: bool = False  # train augmentation: mirror half the images (not for digits or text)
        image_size: int | None = None  # the plain CNN: resize images to this square; None: their own size (all alike)
        norm: Literal["group", "batch", "none"] = "group"  # the plain CNN's normalisation, as for --task digits
        config_overrides: str | None = None  # a transformers model: applied to its config, e.g. "num_hidden_layers=2"
        dropout: float | None = None  # a transformers model: every dropout probability; None: the model's own

        def __post_init__(self):
            if self.random_crop_padding < 0:
                raise UsageError(f"--random_crop_padding must be >= 0 (got {self.random_crop_padding})")
            if self.image_size is not None and self.image_size <= 0:
                raise UsageError(f"--image_size must be > 0 (got {self.image_size})")
            if self.dropout is not None and not 0 <= self.dropout < 1:
                raise UsageError(f"--dropout must lie in [0, 1) (got {self.dropout})")

    default_data_files = {"train": "data/digit_images/train", "eval": "data/digit_images/eval"}
    export_checkpoints = True  # every checkpoint's model/ holds the label names too
    labels: list[str] | None = None  # the class names in id order: from the train split, or a trained model's
    processor = None  # a transformers model's image processor; None: the plain CNN

    def __init__(self, config, options=None):
        super().__init__(config, options)
        if is_transformers_model(config.model_name_or_path):
            hf(config.model_name_or_path).require_transformers()
            from transformers import AutoImageProcessor

            if self.options.image_size is not None:
                raise UsageError("--image_size is the plain CNN's; a transformers model's image processor sizes images")
            self.model_path = hf().check_model_source(config.model_name_or_path)
            self.processor = AutoImageProcessor.from_pretrained(self.model_path)
        elif given := [name for name in ("config_overrides", "dropout") if getattr(self.options, name) is not None]:
            raise UsageError(f"--{given[0]} is a transformers model's (--model_name_or_path); the plain CNN has none")

    # --- data ---

    def build_datasets(self) -> tuple[ImageSamples, ImageSamples]:
        names = [self.config.train_split, self.config.eval_split]
        splits = self.load(names, labelled=True)
        self.labels = class_names(splits[names[0]], self.options.label_column)
        options = self.options
        augmentation = Augmentation(options.random_crop_padding, options.horizontal_flip)
        train = self.samples(splits[names[0]], names[0], augmentation=augmentation if augmentation.active else None)
        return train, self.samples(splits[names[1]], names[1])

    def build_eval_dataset(self, split: str, labelled: bool = True) -> ImageSamples:
        data = self.load([split], labelled)[split]
        if self.labels is None:  # no training in this run: the label names saved with the model
            self.labels = self.saved_labels()
        return self.samples(data, split, labelled=labelled)

    def load(self, names: list[str], labelled: bool) -> dict:
        """The splits, each checked for its columns; an image folder's images labelled by its class subfolders."""
        import datasets

        if importlib.util.find_spec("PIL") is None:  # the Quickstart installs the core's requirements only
            raise UsageError("--task image_classification needs Pillow: pip install -r requirements/images.txt")
        for name in names:  # the likely slip before any data is read: the digit images not written yet
            path = self.split_path(name)
            if path is not None and path == self.default_data_files.get(name) and not Path(path).is_dir():
                raise UsageError(
                    f"the image folder {path} is not in {Path.cwd()}; write the digits' images once with "
                    "`python scripts/make_image_folder.py` in the repository, or point --data_files at your own folders"
                )
        for name in names if labelled else []:
            self.check_class_folders(name)
        options, splits = self.options, load_splits(self.config, names)
        loaded = {}
        for name in names:
            split = splits[name]
            columns = [options.image_column, *[options.label_column] * labelled]
            check_columns(split, columns, self.COLUMN_FLAGS, name)
            check_complete(split, columns, name)
            if not isinstance(split.features[options.image_column], datasets.Image):  # paths or bytes: decode them
                split = split.cast_column(options.image_column, datasets.Image())
            loaded[name] = split
        return loaded

    COLUMN_FLAGS = "--image_column / --label_column"

    def check_class_folders(self, split: str) -> None:
        """A folder of images without class subfolders has no labels (datasets would label them by the split
        folder's own name): one line saying how to give them."""
        folder = self.split_folder(split)
        if folder is not None and not any(path.is_dir() for path in folder.iterdir()):
            raise MissingColumns(
                f"the {split} folder {folder} has no class subfolders to label its images by",
                f"put each class's images in a subfolder named after it ({folder}/<class>/*.png, two classes or more)",
            )

    def split_path(self, split: str) -> str | None:
        """What a split's data_files names on this machine, or None (a Hub dataset, a split it does not name)."""
        return self.config.data_files.get(split) if reads_local_files(self.config) else None

    def split_folder(self, split: str) -> Path | None:
        """The folder a split's data_files names, or None (files, a Hub dataset)."""
        path = self.split_path(split)
        return Path(path) if path is not None and Path(path).is_dir() else None

    def samples(self, split, name: str, labelled: bool = True, augmentation=None) -> ImageSamples:
        preprocess = Preprocess(self.processor, self.options.image_size)
        column = self.options.image_column
        if not labelled:
            return ImageSamples(split.select_columns([column]), column, preprocess)
        ids, names = {label: i for i, label in enumerate(self.labels)}, row_labels(split, self.options.label_column)
        unknown = set(names) - set(ids)
        if unknown:
            raise UsageError(
                f"the {name} split has labels the model does not know: {sorted(unknown)[:5]} "
                f"(it knows {', '.join(self.labels)})"
            )
        labels = torch.tensor([ids[label] for label in names])
        return ImageSamples(split.select_columns([column]), column, preprocess, labels, augmentation, self.config.seed)

    def saved_labels(self) -> list[str]:
        if self.processor is not None:
            id2label = hf().load_config(self.model_path, None, None).id2label
            return [id2label[i] for i in range(len(id2label))]
        labels = saved_labels(saved_model_dir(self.config.model_name_or_path))
        if labels is None:
            raise UsageError(
                f"--model_name_or_path {self.config.model_name_or_path} has no {LABELS_FILE}: "
                "not a model trained by --task image_classification"
            )
        return labels

    def prediction_ids(self, split: str) -> list | None:
        """The --id_column where the split has one, else each image's file (relative to its split's folder)."""
        import datasets

        data = load_splits(self.config, [split])[split]
        if self.config.id_column in data.column_names:
            return data[self.config.id_column]
        column = self.options.image_column
        paths = [image["path"] for image in data.cast_column(column, datasets.Image(decode=False))[column]]
        if None in paths:
            return None
        folder = self.split_folder(split)
        root = folder.resolve() if folder is not None else None
        return [relative(path, root) for path in paths]

    # --- model ---

    def build_model(self) -> nn.Module:
        if self.processor is None:
            return DigitsCNN(num_labels=len(self.labels), norm=self.options.norm, in_channels=3)
        from transformers import AutoModelForImageClassification

        options = self.options
        config = hf().load_config(
            self.model_path, options.config_overrides, options.dropout, num_labels=len(self.labels),
            **label_maps(self.labels),
        )  # fmt: skip
        # a model with another head (e.g. ImageNet's 1,000 classes) gets a fresh one for these labels
        return AutoModelForImageClassification.from_pretrained(
            self.model_path, config=config, ignore_mismatched_sizes=True
        )

    def load_model(self, path: str) -> nn.Module:
        if self.processor is not None:
            return self.build_model()  # from_pretrained loads --model_name_or_path
        return super().load_model(path)

    def logits(self, model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        return model(inputs) if self.processor is None else model(pixel_values=inputs).logits

    def prediction_rows(self, outputs: dict[str, torch.Tensor]) -> list[dict]:
        """The predicted class by its name."""
        rows = super().prediction_rows(outputs)
        return [{**row, "prediction": self.labels[row["prediction"]]} for row in rows]

    def save_model(self, accelerator, model: nn.Module, directory: Path) -> None:
        """A transformers model: save_pretrained with its image processor (what `pipeline` loads); the plain CNN:
        model.safetensors and labels.json."""
        if self.processor is not None:
            return hf().save_pretrained(accelerator, model, self.processor, directory)
        super().save_model(accelerator, model, directory)
        if accelerator.is_main_process:
            save_labels(directory, self.labels)


def class_names(split, column: str) -> list[str]:
    """The train split's class names in id order: an image folder's in its sorted subfolder order, a column's values
    sorted (integers as numbers), as text."""
    import datasets

    feature = split.features[column]
    if isinstance(feature, datasets.ClassLabel):
        return [feature.names[i] for i in sorted(set(split[column]))]
    return [str(value) for value in sorted(set(split[column]))]


def row_labels(split, column: str) -> list[str]:
    """Each row's label name (an image folder's class subfolder, or the value as text)."""
    import datasets

    feature, values = split.features[column], split[column]
    if isinstance(feature, datasets.ClassLabel):
        return feature.int2str(list(values))
    return [str(value) for value in values]


def relative(path: str, root: Path | None) -> str:
    resolved = Path(path).resolve()
    return str(resolved.relative_to(root)) if root is not None and resolved.is_relative_to(root) else path


def hf(model: str | None = None):
    """The hf feature's loading and saving of transformers models, for a transformers image model (the plain CNN
    needs none of it); without that feature, one line saying so (for `model` not a folder: that it is missing)."""
    try:
        from src.features.hf import base
    except ModuleNotFoundError as err:
        if model is not None and not Path(model).is_dir():  # most often a run's model/ not trained yet, or a typo
            raise UsageError(
                f"--model_name_or_path {model}: no such model folder (a Hub model would need the hf feature, "
                "src/features/hf/, not in this project)"
            ) from err
        raise UsageError(
            "a transformers image model needs the hf feature (src/features/hf/), not in this project; "
            "leave out --model_name_or_path to train the plain CNN"
        ) from err
    return base
