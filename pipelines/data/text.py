"""The text the tokenizer sees (:func:`canonical_text`), apart from the tokenize stage, so that what reads text as
the model does (the served model, bits per byte, the exports) loads no stage."""
from __future__ import annotations

import unicodedata


def canonical_text(text: str) -> str:
    """The text the tokenizer sees (and decodes back to): NFKC, newlines as ``\\n``. Not MinHash's
    ``normalize`` (lowercase, punctuation dropped), which only decides what counts as a duplicate."""
    if not text.isascii() and not unicodedata.is_normalized("NFKC", text):  # ASCII is NFKC already
        text = unicodedata.normalize("NFKC", text)
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text
