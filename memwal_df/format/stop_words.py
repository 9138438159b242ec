"""Stop-word lists of Lance 14's inverted-index tokenizer (`remove_stop_words=True`), by language.

Source: pylance 14.0.2 itself. Its English list is neither tantivy's (Lucene's 33 words: Lance keeps
"no", "not") nor Snowball's (Lance keeps "would", "could", "ought"); it is NLTK's English list without
negations, contraction fragments and a few others. The list below is every word Lance 14 removes
among the union of the Lucene, Snowball and NLTK English lists plus common function words (171
candidates, probed one document per word; `tests/test_fts.py` re-checks all of them against Lance).
Languages missing here are not supported with stop-word removal (`InvalidConfigError`).
"""

from __future__ import annotations

__all__ = ["STOP_WORDS"]

_ENGLISH = """
a about above after again against all am an and any are as at be because been before being below
between both but by can did do does doing down during each few for from further had has have having
he her here hers herself him himself his how i if in into is it its itself just me more most my
myself now of off on once only or other our ours ourselves out over own re same she should so some
such than that the their theirs them themselves then there these they this those through to too
under until up very was we were what when where which while who whom why will with you your yours
yourself yourselves
"""

STOP_WORDS: dict[str, frozenset[str]] = {"English": frozenset(_ENGLISH.split())}
