"""Make tiny, randomly initialised BERT and GPT-2 models with their own tokenizers, offline, for tests and examples
(and a tiny ViT with its image processor).

    python scripts/make_tiny_model.py                                   # both, into data/tiny/bert and data/tiny/gpt2
    python scripts/make_tiny_model.py --kind bert --out data/tiny/bert
    python scripts/make_tiny_model.py --kind gpt2 --out data/tiny/gpt2
    python scripts/make_tiny_model.py --kind vit                        # data/tiny/vit, for 8x8 images

Each folder is what `from_pretrained` loads: a tokenizer trained here with the `tokenizers` library on the Python
standard library's source (the files scripts/prepare_text.py reads, capped to a few MB) and a model built from a
tiny config with a fixed seed. BERT: a lowercasing WordPiece tokenizer and a `BertModel` (no head, so
`AutoModelForSequenceClassification.from_pretrained(folder, num_labels=N)` adds a fresh classifier). GPT-2: a
byte-level BPE tokenizer (`<|endoftext|>` is bos, eos, unk and pad) and a `GPT2LMHeadModel`. ViT (only with
`--kind vit`): a `ViTModel` for 8x8 RGB images in 2x2 patches, no head (`AutoModelForImageClassification` adds one),
and a `ViTImageProcessor` that scales pixels to [-1, 1]. The result is the same on every run with this Python and
these library versions; it is git-ignored and rebuilt in seconds.
"""

import argparse
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

try:  # the Quickstart installs the core's requirements only
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertModel, BertTokenizer, GPT2Config, GPT2LMHeadModel, GPT2Tokenizer
except ImportError as err:
    if __name__ != "__main__":
        raise
    print(f"error: making the tiny models needs {err.name}: pip install -r requirements/hf.txt", file=sys.stderr)
    sys.exit(2)

from scripts.prepare_text import read_capped, source_files  # noqa: E402

KINDS = ("bert", "gpt2", "vit")
TEXT_KINDS = ("bert", "gpt2")  # what the script makes without --kind
VOCAB_SIZE = 2000
TEXT_MB = 3  # enough text for a 2,000-token vocabulary; training on it takes about a second
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] first: pad id 0, as in the original BERT
GPT2_SPECIAL = "<|endoftext|>"


def training_texts(max_mb: float) -> list[str]:
    """Stdlib source files, in sorted path order so that the trained vocabulary is the same on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, _ = read_capped(root, source_files(root), int(max_mb * 2**20))
    return [texts[path] for path in sorted(texts)]


def bert_tokenizer(texts: list[str]) -> BertTokenizer:
    # The same normalizer, pre-tokenizer and decoder that BertTokenizer builds when from_pretrained loads the folder
    # (it keeps only the vocabulary and post-processor of tokenizer.json), so the saved tokenizer splits text
    # exactly as the trained one.
    backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE, special_tokens=BERT_SPECIAL, show_progress=False)
    backend.train_from_iterator(texts, trainer)
    # The trainer numbers the "##" sub-word alphabet in hash-map order, which changes from run to run (the tokens do
    # not): number everything after the special tokens alphabetically so that the same text gives the same ids.
    trained = backend.get_vocab()
    tokens = BERT_SPECIAL + sorted(set(trained) - set(BERT_SPECIAL))
    backend.model = models.WordPiece({token: i for i, token in enumerate(tokens)}, unk_token="[UNK]")
    return BertTokenizer(tokenizer_object=backend, model_max_length=128)  # sets the [CLS] ... [SEP] template


def gpt2_tokenizer(texts: list[str]) -> GPT2Tokenizer:
    # As for BERT: the pipeline GPT2Tokenizer rebuilds on load. The byte alphabet makes every string encodable.
    backend = Tokenizer(models.BPE(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[GPT2_SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    # GPT-2 has no pad token of its own; eos as pad is the usual choice (the attention mask hides it)
    return GPT2Tokenizer(tokenizer_object=backend, pad_token=GPT2_SPECIAL, model_max_length=256)


def bert_model(tokenizer: BertTokenizer, hidden_size: int = 64, intermediate_size: int = 128) -> BertModel:
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=intermediate_size,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
    )
    return BertModel(config)


def gpt2_model(tokenizer: GPT2Tokenizer) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=64,
        n_layer=2,
        n_head=2,
        n_positions=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


BUILDERS = {"bert": (bert_tokenizer, bert_model), "gpt2": (gpt2_tokenizer, gpt2_model)}


def make_vit(out: Path) -> None:
    # the PIL processor: the default one warns without torchvision and falls back to it (the same saved config)
    from transformers import ViTConfig, ViTImageProcessorPil, ViTModel

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=8,
        patch_size=2,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
    )
    model = ViTModel(config, add_pooling_layer=False)  # the classifier reads the [CLS] token's final state
    processor = ViTImageProcessorPil(size={"height": 8, "width": 8}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    out.mkdir(parents=True, exist_ok=True)
    processor.save_pretrained(out)
    model.save_pretrained(out)
    print(f"wrote vit to {out}: {sum(p.numel() for p in model.parameters()):,} parameters, 8x8 RGB images")


def make(kind: str, out: Path, texts: list[str]) -> None:
    make_tokenizer, make_model = BUILDERS[kind]
    tokenizer = make_tokenizer(texts)
    torch.manual_seed(0)  # the same initial weights on every run
    model = make_model(tokenizer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"wrote {kind} to {out}: {parameters:,} parameters, vocabulary {len(tokenizer):,}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, help="one kind only (default: bert and gpt2)")
    parser.add_argument("--out", type=Path, help="output folder (default: data/tiny/<kind>; needs --kind)")
    parser.add_argument("--text_mb", type=float, default=TEXT_MB, help="MB of stdlib source to train tokenizers on")
    args = parser.parse_args(argv)
    if args.out is not None and args.kind is None:
        parser.error("--out needs --kind: two kinds cannot share a folder")
    if args.text_mb <= 0:
        parser.error(f"--text_mb must be > 0 (got {args.text_mb})")

    kinds = [args.kind] if args.kind else TEXT_KINDS
    texts = training_texts(args.text_mb) if set(kinds) & set(TEXT_KINDS) else []
    for kind in kinds:
        out = args.out or Path("data/tiny") / kind
        make_vit(out) if kind == "vit" else make(kind, out, texts)


if __name__ == "__main__":
    from transformers.utils import logging as transformers_logging

    from src.imports import hidden

    transformers_logging.disable_progress_bar()  # a shard or two: a bar per model says nothing
    with hidden("deepspeed"):  # transformers' save probes it; importing it prints DeepSpeed's accelerator warning
        main()
