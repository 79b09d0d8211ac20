"""A model directory's tokenizer (transformers' AutoTokenizer), where it has one."""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def load_tokenizer(source: str):
    """The tokenizer of an HF-format model directory, or None: a preset, a directory without tokenizer files, or no
    transformers installed."""
    path = Path(source)
    if not path.is_dir() or not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(str(path))
