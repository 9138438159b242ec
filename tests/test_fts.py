"""fts: BM25 scores equal a plain-Python BM25 over the deduplicated table (tests/support/reference.py oracle),
never a stale or deleted row, filters, MemTable-only tables, SQL; the tokenizer against Lance's index."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import datafusion
import lance
import numpy as np
import pyarrow as pa
import pytest
import snowballstemmer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lance.file import LanceFileReader
from support.search_oracle import HISTORY_OPS, SearchLsm, assert_bm25, bm25, history, make_rows

import memwal_df as mw
from memwal_df.errors import InvalidConfigError
from memwal_df.format.stop_words import STOP_WORDS
from memwal_df.format.tokenizer import Tokenizer
from memwal_df.read.search.planner import plan_fts

QUERIES = ["apple", "kiwi fig", "quince sloe yuzu", "Apple, APPLE pear!", "nothing-here", "date"]


def fts(lsm: SearchLsm, query: str, k: int, with_writer: bool = True, **options: Any) -> pa.Table:
    return plan_fts(lsm.reader(with_writer), "text", query, k, options or None).to_table()


def with_index(uri: str) -> None:
    lance.dataset(uri).create_scalar_index("text", "INVERTED", stem=False, remove_stop_words=False)


@pytest.fixture(params=["no index", "inverted index"])
def lsm(tmp_path: Path, request: pytest.FixtureRequest) -> Any:
    t = SearchLsm(str(tmp_path / "t"), list(range(150)))
    if request.param == "inverted index":
        with_index(t.uri)
    history(t)
    yield t
    t.close()


@pytest.mark.parametrize("with_writer", [True, False])
def test_bm25_equals_reference(lsm: SearchLsm, with_writer: bool) -> None:
    truth = lsm.rows(with_writer)
    for query in QUERIES:
        for k in (1, 10, 500):
            assert_bm25(fts(lsm, query, k, with_writer), truth, bm25(truth, query), k)


def test_filters_combined_with_fts(lsm: SearchLsm) -> None:
    truth = lsm.rows()
    cases = {
        "category = 'a'": lambda r: r["category"] == "a",
        "id >= 20 AND id < 60": lambda r: 20 <= r["id"] < 60,
        "id = 27": lambda r: r["id"] == 27,
    }
    for text, where in cases.items():
        for query in QUERIES:
            want = bm25(truth, query, where)  # statistics over the whole table, scores of matching rows
            assert_bm25(fts(lsm, query, 10, filter=text), truth, want, 10)


def test_memtable_only(tmp_path: Path) -> None:
    lsm = SearchLsm(str(tmp_path / "t"), [])
    lsm.put(list(range(50)), seed=1)
    lsm.put(list(range(10, 20)), seed=2)
    lsm.delete([11, 12])
    truth = lsm.rows()
    for query in QUERIES:
        assert_bm25(fts(lsm, query, 10), truth, bm25(truth, query), 10)
    assert fts(lsm, "apple", 10, with_writer=False).num_rows == 0
    lsm.close()


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=HISTORY_OPS, k=st.integers(1, 30), query=st.sampled_from(QUERIES), indexed=st.booleans())
def test_hypothesis_histories(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Any], k: int, query: str, indexed: bool
) -> None:
    lsm = SearchLsm(str(tmp_path_factory.mktemp("h") / "t"), list(range(40)))
    if indexed:
        with_index(lsm.uri)
    try:
        lsm.replay(ops)
        truth = lsm.rows()
        assert_bm25(fts(lsm, query, k), truth, bm25(truth, query), k)
        where = lambda r: r["category"] != "b"  # noqa: E731
        assert_bm25(fts(lsm, query, k, filter="category <> 'b'"), truth, bm25(truth, query, where), k)
    finally:
        lsm.close()


TEXTS = [
    "Hello, World! hello-world",
    "don't stop_me now x1y",
    "Café crème brûlée",
    "ÉCOLE naïve STRASSE straße Smørrebrød",
    "abcdefg abcdefgh abcdefghi",
    "tabs\tand\nnewlines  and   spaces",
    "日本語 テキスト 123 4.5",
    "",
    None,
]


@pytest.mark.parametrize("base_tokenizer", ["simple", "whitespace"])
def test_tokenizer_matches_lance_index(tmp_path: Path, base_tokenizer: str) -> None:
    """For every term our tokenizer finds, the documents Lance's inverted index (same settings)
    returns for it are exactly the documents our tokenizer puts it in."""
    uri = str(tmp_path / "d")
    data = pa.table({"id": list(range(len(TEXTS))), "text": pa.array(TEXTS, pa.string())})
    ds = lance.write_dataset(data, uri)
    ds.create_scalar_index(
        "text",
        "INVERTED",
        base_tokenizer=base_tokenizer,
        stem=False,
        remove_stop_words=False,
        max_token_length=9,
    )
    ds = lance.dataset(uri)
    tokenizer = Tokenizer.from_index_details(ds.describe_indices()[0].details)
    assert tokenizer.max_token_length == 9
    docs, tokens = tokenizer.tokenize(pa.array(TEXTS, pa.string()))
    words = tokens.dictionary.take(tokens.indices).to_pylist()
    ours: dict[str, set[int]] = {}
    for doc, word in zip(docs.tolist(), words, strict=True):
        ours.setdefault(word, set()).add(doc)
    if base_tokenizer == "simple":
        assert {
            "hello",
            "world",
            "stop",
            "me",
            "x1y",
            "cafe",
            "ecole",
            "strasse",
            "creme",
            "123",
            "4",
            "5",
        } <= set(ours)
    assert "abcdefghi" not in ours and "abcdefgh" in ours  # max_token_length: 9 bytes and longer dropped
    for word, expected in ours.items():
        found = ds.to_table(full_text_query=word, columns=["id"], limit=100).column("id").to_pylist()
        assert set(found) == expected, word


def test_unsupported_index_settings_and_bad_input_raise(tmp_path: Path) -> None:
    lsm = SearchLsm(str(tmp_path / "t"), list(range(20)))
    bad_args: list[tuple[Any, ...]] = [
        ("vec", "apple", 5, None),
        ("text", "apple", 0, None),
        ("text", 3, 5, None),
        ("text", "a", 5, {"metric": "l2"}),
    ]
    for args in bad_args:
        with pytest.raises(InvalidConfigError):
            plan_fts(lsm.reader(), *args)
    lance.dataset(lsm.uri).create_scalar_index("text", "INVERTED", base_tokenizer="ngram")
    with pytest.raises(InvalidConfigError, match="base_tokenizer=ngram"):
        fts(lsm, "apple", 5)
    lsm.close()


def test_sql_results_are_relations(lsm: SearchLsm) -> None:
    ctx = mw.register(datafusion.SessionContext())
    ctx.register_table("t", lsm.reader())
    truth = lsm.rows()
    got = ctx.sql("SELECT * FROM fts('t', 'text', 'kiwi fig', 10) ORDER BY _score DESC").to_arrow_table()
    assert_bm25(got, truth, bm25(truth, "kiwi fig"), 10)
    options = "named_struct('filter', 'category = ''b''')"
    got = ctx.sql(
        f"SELECT f.id, f._score FROM fts('t', 'text', 'apple', 20, {options}) f "
        "JOIN t ON f.id = t.id WHERE f._score > 0.1 ORDER BY f._score DESC, f.id"
    ).to_arrow_table()
    want = bm25(truth, "apple", lambda r: r["category"] == "b")
    top20 = sorted(want.values(), reverse=True)[:20]
    np.testing.assert_allclose(got["_score"].to_numpy(), [s for s in top20 if s > 0.1], rtol=0, atol=1e-6)
    pairs = zip(got["id"].to_pylist(), got["_score"].to_pylist(), strict=True)
    assert all(abs(want[i] - s) <= 1e-6 for i, s in pairs)
    lines = ctx.sql("SELECT line FROM memwal_explain_search('fts', 't', 'text', 'apple', 5)").to_pandas()[
        "line"
    ]
    assert lines[0].startswith("GlobalBM25Exec: k=5, order_by=[_score DESC], terms=['apple'], docs=")


def test_string_keys(tmp_path: Path) -> None:
    """Keys of another type: the base's newer keys are located by hash lookup, not binary search."""
    lsm = SearchLsm(str(tmp_path / "t"), list(range(150)), str_keys=True)
    with_index(lsm.uri)
    history(lsm)
    truth = lsm.rows()
    for query in QUERIES:
        assert_bm25(fts(lsm, query, 10), truth, bm25(truth, query), 10)
    lsm.close()


@settings(max_examples=200, deadline=None)
@given(texts=st.lists(st.one_of(st.none(), st.text(alphabet=st.sampled_from("aZ09 \t\n-_.,'é")))))
def test_simple_tokenizer_against_regex_reference(texts: list[str | None]) -> None:
    """The ASCII fast path and the Unicode regex split alike (runs of letters and digits)."""
    docs, tokens = Tokenizer().tokenize(pa.array(texts, pa.string()))
    got: dict[int, list[str]] = {}
    for doc, word in zip(docs.tolist(), tokens.dictionary.take(tokens.indices).to_pylist(), strict=True):
        got.setdefault(doc, []).append(word)
    want = {
        i: [w.lower().replace("é", "e") for w in re.findall(r"[^\W_]+", text)]
        for i, text in enumerate(texts)
        if text and re.findall(r"[^\W_]+", text)
    }
    assert got == want


# Stemming and stop words (Lance's default inverted index), checked against Lance 14 itself.

LANCE_KEEPS = (
    "ain also aren cannot could couldn d didn doesn don hadn hasn haven isn ll m ma may might mightn must "
    "mustn needn no nor not o ought s shall shan shouldn t upon us ve wasn weren whose won would wouldn y yet"
).split()
STEM_WORDS = (
    "run runs running runner ran connect connected connection connections generous generously "
    "happy happiness happily cats cat dogs agreed agreement ons ifs thes caresses ponies"
).split()


def index_lengths(uri: str) -> dict[int, int]:
    """Each document's token count in Lance's inverted index (documents without tokens are absent)."""
    out: dict[int, int] = {}
    for path in Path(uri).glob("_indices/*/part_*_docs.lance"):
        docs = LanceFileReader(str(path)).read_all().to_table()
        out.update(zip(docs["_rowid"].to_pylist(), docs["_num_tokens"].to_pylist(), strict=True))
    return out


def check_against_lance(tmp_path: Path, texts: list[str], **params: Any) -> None:
    """Our tokens of `texts` against Lance's index with `params`: the same token count per document,
    and for every word of every text, Lance's query for it finds exactly the documents holding our
    term for it (Lance tokenizes the query with the index's tokenizer, as we do)."""
    uri = str(tmp_path / "d")
    ds = lance.write_dataset(pa.table({"id": list(range(len(texts))), "text": texts}), uri)
    ds.create_scalar_index("text", "INVERTED", **params)
    ds = lance.dataset(uri)
    tokenizer = Tokenizer.from_index_details(ds.describe_indices()[0].details)
    docs, tokens = tokenizer.tokenize(pa.array(texts, pa.string()))
    ours: dict[str, set[int]] = {}
    for doc, word in zip(docs.tolist(), tokens.dictionary.take(tokens.indices).to_pylist(), strict=True):
        ours.setdefault(word, set()).add(doc)
    lengths = {i: n for i, n in enumerate(np.bincount(docs, minlength=len(texts)).tolist()) if n}
    assert lengths == index_lengths(uri)
    for word in {w for t in texts for w in re.findall(r"\w+", t)}:
        got = ds.to_table(full_text_query=word, columns=["id"], limit=1000).column("id").to_pylist()
        want = set().union(*(ours.get(t, set()) for t in tokenizer.terms(word)))
        assert set(got) == want, word


def test_english_stop_words_are_lances(tmp_path: Path) -> None:
    """One document per word: Lance removes exactly our stop words (stemming off)."""
    words = sorted(STOP_WORDS["English"]) + LANCE_KEEPS
    uri = str(tmp_path / "d")
    ds = lance.write_dataset(pa.table({"id": list(range(len(words))), "text": words}), uri)
    ds.create_scalar_index("text", "INVERTED", stem=False)
    lengths = index_lengths(uri)
    assert {w for i, w in enumerate(words) if i not in lengths} == STOP_WORDS["English"]


LANGUAGE_TEXTS = {
    "English": ["The runners were running and the dogs ran", "Connections connected generously", "ons ifs"],
    "French": ["Les chats mangeaient des pommes délicieuses", "nationalité nationales mangées", "été étés"],
    "German": ["Die Häuser waren schöner als die Bäume", "Katzen katzenhaft Häusern", "Straßen straße"],
    "Spanish": ["Los niños corrían rápidamente", "canciones cantando cantaré", "árboles"],
    "Italian": ["I gatti mangiavano le mele", "nazionalità nazionali cantando", "perché"],
    "Portuguese": ["Os gatos comiam maçãs", "nacionalidade nacionais cantando", "coração"],
    "Russian": ["Кошки ели яблоки", "красивая красивые красивого", "ёлка"],
}


@pytest.mark.parametrize("language", sorted(LANGUAGE_TEXTS))
def test_stemmed_tokenizer_matches_lance_index(tmp_path: Path, language: str) -> None:
    texts = LANGUAGE_TEXTS[language] + [" ".join(STEM_WORDS), "Café CAFÉS naïve"]
    stop = language == "English"
    check_against_lance(tmp_path, texts, language=language, remove_stop_words=stop)


@pytest.mark.parametrize("ascii_folding", [True, False])
def test_default_index_matches_lance(tmp_path: Path, ascii_folding: bool) -> None:
    texts = [" ".join(STEM_WORDS[:12]), "It is not the Café we wanted", "été naïve", "", "THE", *STEM_WORDS]
    check_against_lance(tmp_path, texts, ascii_folding=ascii_folding)


VOCABULARY = STEM_WORDS + sorted(STOP_WORDS["English"])[:40] + LANCE_KEEPS[:10] + ["café", "Naïve", "x1"]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(st.lists(st.sampled_from(VOCABULARY), max_size=12).map(" ".join), min_size=1))
def test_hypothesis_default_index_terms(tmp_path_factory: pytest.TempPathFactory, texts: list[str]) -> None:
    check_against_lance(tmp_path_factory.mktemp("h"), texts)


def reference_terms(text: str) -> list[str]:
    """Lance's default English pipeline for ASCII text, word by word: split, lower-case, Snowball
    stem, drop stop words."""
    stemmer = snowballstemmer.stemmer("english")
    stems = (stemmer.stemWord(w) for w in re.findall(r"[a-z0-9]+", text.lower()))
    return [s for s in stems if s not in STOP_WORDS["English"]]


def put_sentences(lsm: SearchLsm, ids: list[int], seed: int) -> None:
    rows = make_rows(ids, seed)
    rng = np.random.default_rng(seed)
    vocabulary = np.array(STEM_WORDS + ["the", "and", "not", "would", "apple"])
    text = [" ".join(rng.choice(vocabulary, int(rng.integers(1, 10)))) for _ in ids]
    lsm.writer.put(rows.set_column(rows.schema.get_field_index("text"), "text", pa.array(text)))


STEM_QUERIES = ["running", "the runner", "Connection happy", "not", "would ons", "the and"]


def test_bm25_with_default_index_equals_reference(tmp_path: Path) -> None:
    lsm = SearchLsm(str(tmp_path / "t"), [])
    put_sentences(lsm, list(range(60)), seed=1)
    lsm.merge()
    lance.dataset(lsm.uri).create_scalar_index("text", "INVERTED")  # Lance's defaults: stem, stop words
    put_sentences(lsm, list(range(40, 90)), seed=2)
    lsm.flush()
    put_sentences(lsm, list(range(10, 30)), seed=3)
    lsm.delete([12, 45, 80])
    truth = lsm.rows()
    for query in STEM_QUERIES:
        want = bm25(truth, query, tokenize=reference_terms)
        for k in (1, 10, 200):
            assert_bm25(fts(lsm, query, k), truth, want, k)
    lsm.close()


def test_unsupported_languages_raise() -> None:
    details = {"stem": True, "remove_stop_words": False, "language": "Tamil"}
    with pytest.raises(InvalidConfigError, match="stem with language=Tamil"):
        Tokenizer.from_index_details(details)
    details = {"stem": False, "remove_stop_words": True, "language": "French"}
    with pytest.raises(InvalidConfigError, match="remove_stop_words with language=French"):
        Tokenizer.from_index_details(details)
