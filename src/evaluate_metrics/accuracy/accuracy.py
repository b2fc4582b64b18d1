"""Accuracy as a local `evaluate` module: the Hub's "accuracy" needs a network, this one loads offline.

Copy this folder to add a metric (the file name must match the folder name), then list it in --metrics.
"""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions equal to their reference label.",
            citation="",
            inputs_description="predictions: list of int class ids; references: list of int class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        correct = sum(int(p == r) for p, r in zip(predictions, references, strict=True))
        return {"accuracy": correct / len(references) if references else 0.0}
