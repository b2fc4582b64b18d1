"""scripts/make_tiny_model.py and scripts/make_text_data.py: offline assets that the Auto classes load and run."""

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import needs_package

# transformers is imported by the tests that run, not at collection: ~1 s in every pytest run (and removal check)
pytestmark = needs_package("transformers", "pip install -r requirements/hf.txt")

TEXTS = ["x = 1", "def parse(self, text: str) -> list[str]:  # a longer line, with ünïcode and a comment"]
LABELS = {"code", "comment", "def"}


@pytest.fixture(scope="module")
def assets(hf_assets) -> Path:
    """Both scripts with their defaults, run in an empty folder: data/tiny/{bert,gpt2} and data/text there (conftest's
    hf_assets, which the other Hugging Face tests use, is what they made)."""
    return Path(hf_assets["root"])


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def source_file(row: dict) -> str:
    return row["id"].rsplit(":", 1)[0]


def is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, int(n**0.5) + 1))


@pytest.mark.slow  # the module fixture builds both models and the data (~10 s)
def test_models_load_and_forward_a_padded_batch(assets):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    bert, gpt2 = assets / "tiny" / "bert", assets / "tiny" / "gpt2"
    tokenizer = AutoTokenizer.from_pretrained(bert)
    model = AutoModelForSequenceClassification.from_pretrained(bert, num_labels=3).eval()  # a fresh classifier head
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, 3) and torch.isfinite(logits).all()

    tokenizer = AutoTokenizer.from_pretrained(gpt2)
    model = AutoModelForCausalLM.from_pretrained(gpt2).eval()
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        output = model(**batch, labels=labels)
    assert output.logits.shape == (*batch["input_ids"].shape, len(tokenizer)) and torch.isfinite(output.loss)
    assert model.config.n_positions == tokenizer.model_max_length == 256


@pytest.mark.slow  # the module fixture builds both models and the data (~10 s)
def test_tokenizers_pad_with_their_pad_id(assets):
    from transformers import AutoTokenizer

    bert = AutoTokenizer.from_pretrained(assets / "tiny" / "bert")
    assert (bert.pad_token, bert.pad_token_id, bert.model_max_length, len(bert)) == ("[PAD]", 0, 128, 2000)
    batch = bert(TEXTS, padding=True)
    short, long = batch["input_ids"]
    mask = batch["attention_mask"][0]
    assert len(short) == len(long) and sum(mask) < len(mask) and all(batch["attention_mask"][1])
    assert short[: sum(mask)][0] == bert.cls_token_id and short[sum(mask) - 1] == bert.sep_token_id
    assert short[sum(mask) :] == [bert.pad_token_id] * (len(mask) - sum(mask))  # padded on the right
    assert mask == [1] * sum(mask) + [0] * (len(mask) - sum(mask))
    assert len(bert("word " * 500, truncation=True)["input_ids"]) == 128

    gpt2 = AutoTokenizer.from_pretrained(assets / "tiny" / "gpt2")
    assert gpt2.pad_token_id == gpt2.eos_token_id == gpt2.bos_token_id == 0 and len(gpt2) == 2000
    batch = gpt2(TEXTS, padding=True)
    assert "token_type_ids" not in batch and gpt2.eos_token_id not in gpt2(TEXTS[1])["input_ids"]  # none added
    assert gpt2.decode(gpt2(TEXTS[1])["input_ids"]) == TEXTS[1]  # byte-level: every string round-trips


@pytest.mark.slow  # the module fixture builds both models and the data (~10 s)
def test_saved_tokenizers_split_text_as_the_trained_ones(assets):
    from transformers import AutoTokenizer

    """from_pretrained rebuilds a BertTokenizer/GPT2Tokenizer's pipeline from the vocabulary: the saved folder must
    give the ids the trained tokenizer gave, and training again (another process, hash seed) the same ids too."""
    from scripts.make_tiny_model import bert_tokenizer, gpt2_tokenizer, training_texts

    texts = training_texts(3)
    lines = [row["text"] for row in read_jsonl(assets / "text" / "eval.jsonl")] + TEXTS
    for kind, make in (("bert", bert_tokenizer), ("gpt2", gpt2_tokenizer)):
        trained, saved = make(texts), AutoTokenizer.from_pretrained(assets / "tiny" / kind)
        assert trained(lines)["input_ids"] == saved(lines)["input_ids"], kind


@pytest.mark.slow  # the module fixture builds both models and the data (~10 s)
def test_text_data_is_balanced_and_split_by_file(assets):
    train, evaluation = (read_jsonl(assets / "text" / f"{split}.jsonl") for split in ("train", "eval"))
    assert len(train) == 3000 and len(evaluation) == 401 and is_prime(len(evaluation))
    for rows in (train, evaluation):
        assert {row["label"] for row in rows} == LABELS and all(set(row) == {"id", "text", "label"} for row in rows)
        counts = [sum(row["label"] == label for row in rows) for label in LABELS]
        assert max(counts) - min(counts) <= 1
        assert all(3 <= len(row["text"]) <= 200 and row["text"] == row["text"].strip() for row in rows)
    assert not {source_file(row) for row in train} & {source_file(row) for row in evaluation}
    rows = train + evaluation
    assert len({row["id"] for row in rows}) == len({row["text"] for row in rows}) == len(rows)
    for row in rows:  # the label is a function of the text, so it can be learned
        expected = "comment" if row["text"].startswith("#") else "code"
        expected = "def" if row["text"].startswith(("def ", "class ", "async def ")) else expected
        assert row["label"] == expected, row
    lengths = sorted(len(row["text"]) for row in train)
    assert lengths[0] < 10 and lengths[-1] > 80  # short and long lines


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("make_text_data", ["--eval_size", "2"], "--eval_size must be >= 3"),
        ("make_text_data", ["--train_size", "1000000"], "ask for fewer rows"),
        ("make_tiny_model", ["--out", "somewhere"], "--out needs --kind"),
    ],
)
def test_bad_arguments_exit_2(script, args, message, capsys):
    module = __import__(f"scripts.{script}", fromlist=["main"])
    with pytest.raises(SystemExit) as exit_info:
        module.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: " in err and message in err


@pytest.mark.parametrize("hidden", ["transformers", "tokenizers"])
def test_without_the_hf_packages_the_script_names_what_to_install(tmp_path, hidden):
    """The Quickstart installs the core's requirements only: make_tiny_model.py, the first command of the Hugging
    Face page, says what to install in one line, exit 2, writing nothing."""
    import subprocess
    import sys

    from tests.conftest import REPO
    from tests.helpers import assert_error_line

    argv = ["scripts/make_tiny_model.py", "--kind", "bert", "--out", str(tmp_path / "bert")]
    code = f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv = {argv!r}; runpy.run_path({argv[0]!r}, " + (
        "run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert_error_line(result, rf"needs {hidden}: pip install -r requirements/hf\.txt$")
    assert not any(tmp_path.iterdir())
