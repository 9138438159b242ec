"""The full-text tokenizer: Lance's inverted-index tokenization, vectorized with pyarrow.

Configured from the base table's inverted index (`describe_indices()` details), so that every level
tokenizes as the base index does; without an index, Lance's defaults minus stemming and stop words.
Pipeline (Lance 14 / tantivy order, checked against Lance's index in tests/test_fts.py):
1. split: `simple` on every character that is not a Unicode letter or digit; `whitespace` on Unicode
   whitespace;
2. drop tokens of `max_token_length` UTF-8 bytes or more;
3. lower-case (`lower_case`);
4. stemming (`stem`): the Snowball stemmer of `language` (`snowballstemmer`, the algorithms
   rust-stemmers compiles for Lance);
5. stop-word removal (`remove_stop_words`), on the stemmed tokens: `memwal_df.format.stop_words`;
6. ASCII folding (`ascii_folding`): accents removed (Unicode NFKD without combining marks) plus the
   Latin letters NFKD keeps (ß -> ss, æ -> ae, ø -> o, ...).
Steps 4-6 run on each distinct token once (stems are also cached per language).

Not supported (InvalidConfigError names the option): stemming in a language outside
`STEM_LANGUAGES`, stop-word removal in a language outside `memwal_df.format.stop_words.STOP_WORDS`, other
base tokenizers (`raw`, `ngram`, `icu`, ...) and token splitting options. Lance does not record
`custom_stop_words` in the index details: an index built with them is read as using the built-in list.
"""

from __future__ import annotations

import threading
import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import snowballstemmer

from memwal_df.errors import InvalidConfigError
from memwal_df.format.stop_words import STOP_WORDS

__all__ = ["STEM_LANGUAGES", "Tokenizer"]

# Languages whose Snowball stems tests/test_fts.py checks against Lance 14's index.
STEM_LANGUAGES = ("English", "French", "German", "Spanish", "Italian", "Portuguese", "Russian")
_STEM_CACHE_LIMIT = 1 << 20
_stem_caches: dict[str, dict[str, str]] = {}
_stem_lock = threading.Lock()

_SIMPLE_SPLIT = r"[^\p{L}\p{N}]+"
_BASE_TOKENIZERS = ("simple", "whitespace")
_FOLD = str.maketrans(
    {"ß": "ss", "æ": "ae", "Æ": "AE", "ø": "o", "Ø": "O", "œ": "oe", "Œ": "OE", "ł": "l", "Ł": "L",
     "đ": "d", "Đ": "D", "ð": "d", "Ð": "D", "þ": "th", "Þ": "TH", "ı": "i"}
)  # fmt: skip
_UNSUPPORTED_TRUE = (
    "split_identifiers",
    "split_on_numerics",
    "preserve_original",
)


def _fold(token: str) -> str:
    decomposed = unicodedata.normalize("NFKD", token.translate(_FOLD))
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def _stems(language: str, words: list[str]) -> list[str]:
    """The Snowball stems of `words`, through a per-language cache (bounded: cleared when full)."""
    with _stem_lock:
        cache = _stem_caches.setdefault(language, {})
        missing = [w for w in dict.fromkeys(words) if w not in cache]
        if missing:
            if len(cache) + len(missing) > _STEM_CACHE_LIMIT:
                cache.clear()
            stems = snowballstemmer.stemmer(language.lower()).stemWords(missing)
            cache.update(zip(missing, stems, strict=True))
        return [cache[w] for w in words]


@dataclass(frozen=True)
class Tokenizer:
    """Splits texts into terms as a Lance inverted index with the same settings does."""

    base_tokenizer: str = "simple"
    lower_case: bool = True
    max_token_length: int | None = 40
    ascii_folding: bool = True
    language: str = "English"
    stem: bool = False
    remove_stop_words: bool = False

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
        language = details.get("language") or "English"
        stem = bool(details.get("stem"))
        remove_stop_words = bool(details.get("remove_stop_words"))
        if stem and language not in STEM_LANGUAGES:
            bad.append(f"stem with language={language}")
        if remove_stop_words and language not in STOP_WORDS:
            bad.append(f"remove_stop_words with language={language}")
        if bad:
            raise InvalidConfigError(f"fts: the base table's inverted index uses unsupported settings: {bad}")
        return cls(
            base,
            bool(details.get("lower_case", True)),
            details.get("max_token_length"),
            bool(details.get("ascii_folding", True)),
            language,
            stem,
            remove_stop_words,
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
        words = encoded.dictionary
        if self.stem:
            words = pa.array(_stems(self.language, words.to_pylist()), pa.string())
        if self.remove_stop_words:
            stop = pc.is_in(words, pa.array(sorted(STOP_WORDS[self.language]), pa.string())).to_numpy(
                zero_copy_only=False
            )
            keep = ~stop[encoded.indices.to_numpy(zero_copy_only=False)]
            docs = docs[keep]
            indices = encoded.indices.filter(pa.array(keep))
            encoded = pa.DictionaryArray.from_arrays(indices, encoded.dictionary)
        if self.ascii_folding and not pc.all(pc.string_is_ascii(words)).as_py():
            words = pa.array([_fold(t) for t in words.to_pylist()], pa.string())
        if words is not encoded.dictionary or self.remove_stop_words:
            encoded = pc.dictionary_encode(words.take(encoded.indices))
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
