"""The Hugging Face Hub: whether a dataset or model can be reached (a fast, clear answer offline)."""

import os
from pathlib import Path

from src.errors import UsageError

OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as set now, read as huggingface_hub reads it at its import."""
    return any(os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE") for name in OFFLINE)


def check_hub_repo(name: str, kind: str, flag: str, instead: str) -> None:
    """An uncached Hub dataset or model (`kind`): one 10 s request, not ~23 s of retries; `instead`: the offline way."""
    from huggingface_hub import HfApi
    from huggingface_hub.constants import HF_HUB_CACHE
    from huggingface_hub.errors import RepositoryNotFoundError

    if (Path(HF_HUB_CACHE) / f"{kind}s--{name.replace('/', '--')}").exists():  # cached
        return
    if offline():
        raise UsageError(f"{kind} {name!r} is not in the local cache and HF_HUB_OFFLINE is set; {instead}")
    try:
        getattr(HfApi(), f"{kind}_info")(name, timeout=10)
    except RepositoryNotFoundError as err:
        raise UsageError(f"no {kind} {name!r} on the Hugging Face Hub; check {flag}") from err
    except Exception as err:  # DNS, proxy, timeout, HTTP: all mean "can't use the Hub from here"
        raise UsageError(
            f"cannot reach the Hugging Face Hub for {kind} {name!r} ({type(err).__name__}); "
            f"{instead}, or a cached copy with HF_HUB_OFFLINE=1"
        ) from err
