"""`--task image_classification`: image folders, a plain CNN or a `transformers` model (with the hf feature),
augmentation that stays the same on N processes (docs/images.md)."""

from src.features import Feature


class Images(Feature):
    tasks = {"image_classification": "src.features.images.image_classification.ImageClassification"}


FEATURE = Images()
