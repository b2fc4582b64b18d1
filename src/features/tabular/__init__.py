"""`--task tabular`: classify the rows of a table (CSV, JSON or Parquet) with an MLP (docs/customize.md)."""

from src.features import Feature


class TabularFeature(Feature):
    tasks = {"tabular": "src.features.tabular.tabular.Tabular"}


FEATURE = TabularFeature()
