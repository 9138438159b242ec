"""The full-text tokenizer: Lance's inverted-index tokenization, vectorized with pyarrow.

Configured from the base table's inverted index (`describe_indices()` details), so that every level
tokenizes as the base index does; without an index, Lance's defaults minus stemming and stop words.
Pipeline (Lance 14 / tantivy order, checked against Lance's index in tests/test_fts.py):
1. split: `simple` on every character that is not a Unicode letter or digit; `whitespace` on Unicode
   whitespace;
2. drop tokens of `max_token_length` UTF-8 bytes or more;
3. lower-case (`lower_case`);
4. ASCII folding (`ascii_folding`): accents removed (Unicode NFKD without combining marks) plus the
   Latin letters NFKD keeps (ß -> ss, æ -> ae, ø -> o, ...). Applied to each distinct token once.

Not supported (InvalidConfigError names the option): stemming, stop-word removal, other base
tokenizers (`raw`, `ngram`, `icu`, ...) and token splitting options.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from memwal_df.errors import InvalidConfigError

__all__ = ["Tokenizer"]

_SIMPLE_SPLIT = r"[^\p{L}\p{N}]+"
_BASE_TOKENIZERS = ("simple", "whitespace")
_FOLD = str.maketrans(
    {"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L",
     "đ": "d", "Đ": "D", "ð": "d", "Ð": "D", "þ": "th", "Þ": "TH", "ı": "i"}
)  # fmt: skip
_UNSUPPORTED_TRUE = (
    "stem",
    "remove_stop_words",
    "split_identifiers",
    "split_on_numerics",
    "preserve_original",
)


def _fold(token: str) -> str:
    decomposed = unicodedata.normalize("NFKD", token.translate(_FOLD))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


@dataclass(frozen=True)
class Tokenizer:
    """Splits texts into terms as a Lance inverted index with the same settings does."""

    base_tokenizer: str = "simple"
    lower_case: bool = True
    max_token_length: int | None = 40
    ascii_folding: bool = True

    @classmethod
    def from_index_details(cls, details: dict[str, Any] | None) -> Tokenizer:
        """The tokenizer of an inverted index (its `describe_indices()` details); defaults for None."""
        if details is None:
            return cls()
        bad = [name for name in _UNSUPPORTED_TRUE if details.get(name)]
        if details.get("lance_tokenizer") not in (None, "text"):
            bad.append(f"lance_tokenizer={details['lance_tokenizer']}")
        base = details.get("base_tokenizer") or "simple"
        if base not in _BASE_TOKENIZERS:
            bad.append(f"base_tokenizer={base}")
        if bad:
            raise InvalidConfigError(f"fts: the base table's inverted index uses unsupported settings: {bad}")
        return cls(
            base,
            bool(details.get("lower_case", True)),
            details.get("max_token_length"),
            bool(details.get("ascii_folding", True)),
        )

    def tokenize(self, texts: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
        """(document index of each token, the tokens as a dictionary array), in text order. NULL texts
        have no tokens."""
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks() if texts.num_chunks != 1 else texts.chunk(0)
        if pa.types.is_large_string(texts.type):
            texts = texts.cast(pa.string())
        lists = self._split(texts)
        docs = pc.list_parent_indices(lists).to_numpy()
        tokens = pc.list_flatten(lists)
        keep = pc.greater(pc.binary_length(tokens), 0)
        if self.max_token_length is not None:
            keep = pc.and_(keep, pc.less(pc.binary_length(tokens), self.max_token_length))
        tokens = tokens.filter(keep)
        docs = docs[keep.to_numpy(zero_copy_only=False)]
        if self.lower_case:
            tokens = pc.utf8_lower(tokens)
        encoded = pc.dictionary_encode(tokens)
        if self.ascii_folding and not pc.all(pc.string_is_ascii(encoded.dictionary)).as_py():
            folded = pa.array([_fold(t) for t in encoded.dictionary.to_pylist()], pa.string())
            encoded = pc.dictionary_encode(folded.take(encoded.indices))
        return docs, encoded

    def _split(self, texts: pa.Array) -> pa.ListArray:
        """Each text's raw tokens (possibly empty strings). For `simple`, ASCII texts whose
        whitespace-separated words are all letters and digits split on whitespace alone (the same
        tokens, ~10x cheaper than the Unicode regex)."""
        if self.base_tokenizer == "whitespace":
            return pc.utf8_split_whitespace(texts)
        if pc.all(pc.string_is_ascii(texts)).as_py() is not False:
            words = pc.ascii_split_whitespace(texts)
            if pc.all(pc.ascii_is_alnum(pc.list_flatten(words))).as_py() is not False:
                return words
        return pc.split_pattern_regex(texts, _SIMPLE_SPLIT)

    def terms(self, text: str) -> list[str]:
        """The distinct terms of a query, in order of first appearance."""
        _, tokens = self.tokenize(pa.array([text], pa.string()))
        return list(dict.fromkeys(tokens.dictionary.take(tokens.indices).to_pylist()))
