"""Hugging Face `transformers` models: `--task text_classification` and `--task language_modeling`, fine-tuned fully
or with LoRA adapters (`--peft lora`, PEFT); docs/hugging_face.md. Needs requirements/hf.txt."""

from src.features import Feature


class HuggingFace(Feature):
    tasks = {
        "text_classification": "src.features.hf.text_classification.TextClassification",
        "language_modeling": "src.features.hf.language_modeling.LanguageModeling",
    }


FEATURE = HuggingFace()
