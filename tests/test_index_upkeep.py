"""Index upkeep (`memwal_df.jobs.index_upkeep`, through `Table.catch_up_indexes(upkeep=...)`): an
index's segments are merged into one once it has `max_segments`, a vector index is retrained once
the rows assigned since its training pass `retrain_share` of the rows it was trained on (the counts
kept in `_mem_wal/_index_upkeep.json`), and searches stay right through both."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from support.compacting import INDEXES, Lsm, coverage, fragments, segments
from support.jobs import assert_catchup_covered
from support.optional import not_none
from support.search_oracle import nearest

from memwal_df.errors import InvalidConfigError
from memwal_df.format import memwal_index
from memwal_df.jobs.index_upkeep import RECORD_PATH, IndexUpkeepSettings

PARTITIONS = 2


def _record(lsm: Lsm) -> dict:
    return json.loads(lsm.table.storage.get(RECORD_PATH))


def _round(lsm: Lsm, upkeep: IndexUpkeepSettings, **write: object) -> dict:
    """One write, merge and catch-up; the catch-up of each index by name."""
    lsm.generation(**write)  # type: ignore[arg-type]
    lsm.table.merge()
    result = lsm.table.catch_up_indexes(upkeep=upkeep)
    merged = memwal_index.merged_generations(lsm.table.details)
    out = {i.name: i for i in result.indexes}
    assert set(out) == set(INDEXES)
    ds = lsm.dataset()
    for name, i in out.items():  # every index covers the latest version and claims all merges
        assert i.rebuilt and i.covers_latest and not i.unverified, i
        assert coverage(ds)[name] == set(fragments(ds)), name
        assert i.caught_up == merged, name
    return out


def _vec_rows(lsm: Lsm) -> int:
    (d,) = [d for d in lsm.dataset().describe_indices() if d.name == "vec_idx"]
    return d.num_rows_indexed


@pytest.mark.parametrize("bad", [{"max_segments": 0}, {"retrain_share": 0}, {"retrain_share": -1.0}])
def test_bad_upkeep_settings_are_refused(bad):
    with pytest.raises(InvalidConfigError):
        IndexUpkeepSettings(**bad)


def test_segments_are_merged_into_one_at_max_segments(tmp_path):
    upkeep = IndexUpkeepSettings(max_segments=3, retrain_share=100.0)  # never retrains
    lsm = Lsm(str(tmp_path / "t"), base=600, partitions=PARTITIONS)
    seen, merges = [], 0
    for _ in range(7):
        before = len(segments(lsm.dataset(), "vec_idx"))
        vec = _round(lsm, upkeep, new=60)["vec_idx"]
        after = len(segments(lsm.dataset(), "vec_idx"))
        seen.append(after)
        assert not vec.retrained
        if before >= upkeep.max_segments:  # merged with the new fragments into one segment
            assert vec.merged_segments and after == 1
            merges += 1
        else:  # a delta segment (Lance may fold it into a lone first segment)
            assert not vec.merged_segments and after <= before + 1
        assert after <= upkeep.max_segments
        for name in ("id_idx", "text_idx"):
            assert len(segments(lsm.dataset(), name)) == 1
    assert merges >= 2 and upkeep.max_segments in seen, seen
    assert_catchup_covered(lsm.table)


def test_an_index_with_too_many_segments_is_consolidated_without_new_rows(tmp_path):
    lsm = Lsm(str(tmp_path / "t"), base=600, partitions=PARTITIONS)
    loose = IndexUpkeepSettings(max_segments=10, retrain_share=100.0)
    for _ in range(3):
        _round(lsm, loose, new=40)
    assert len(segments(lsm.dataset(), "vec_idx")) == 3
    result = lsm.table.catch_up_indexes(upkeep=IndexUpkeepSettings(max_segments=2, retrain_share=100.0))
    (vec,) = [i for i in result.indexes if i.name == "vec_idx"]
    assert vec.rebuilt and vec.merged_segments and not vec.retrained
    assert len(segments(lsm.dataset(), "vec_idx")) == 1
    assert coverage(lsm.dataset())["vec_idx"] == set(fragments(lsm.dataset()))
    again = lsm.table.catch_up_indexes(upkeep=IndexUpkeepSettings(max_segments=2, retrain_share=100.0))
    assert not any(i.rebuilt for i in again.indexes)  # nothing new, nothing to merge: no commit
    assert again.version == result.version


def test_a_vector_index_is_retrained_once_assigned_rows_pass_the_share(tmp_path):
    """Trained on the 600 base rows; 60 new rows per round: 360 assigned rows pass 0.5 x 600 in the
    sixth round, which retrains (one segment); the count then starts over from the rows indexed."""
    upkeep = IndexUpkeepSettings(max_segments=10, retrain_share=0.5)
    lsm = Lsm(str(tmp_path / "t"), base=600, partitions=PARTITIONS)
    trained, assigned, retrains = 600, 0, []
    for n in range(1, 9):
        done = _round(lsm, upkeep, new=60)
        vec = done["vec_idx"]
        assert not done["id_idx"].retrained and not done["text_idx"].retrained  # scalar: never
        assigned += 60
        due = assigned > not_none(upkeep.retrain_share) * trained
        assert vec.retrained == due, (n, assigned, trained)
        record = _record(lsm)["vec_idx"]
        if due:
            retrains.append(n)
            trained, assigned = _vec_rows(lsm), 0
            assert len(segments(lsm.dataset(), "vec_idx")) == 1
        assert record == {"trained_rows": trained, "assigned_rows": assigned}, n
    assert retrains == [6] and trained == 960
    assert_catchup_covered(lsm.table)


def test_searches_stay_right_through_segment_merges_and_retraining(tmp_path):
    """Updates that move vectors, deletes and new rows, round after round of upkeep (segments merged,
    the index retrained): a stored vector finds its row at distance 0, every returned row is current,
    distances are exact (refined) and recall@10 against brute force stays high."""
    upkeep = IndexUpkeepSettings(max_segments=2, retrain_share=0.3)
    lsm = Lsm(str(tmp_path / "t"), base=600, partitions=PARTITIONS)
    rng = random.Random(5)
    did = {"merged": False, "retrained": False}
    ctx = lsm.context()
    for _ in range(6):
        keys = sorted(lsm.model)
        vec = _round(lsm, upkeep, new=50, update=rng.sample(keys, 40), delete=rng.sample(keys, 10))["vec_idx"]
        did["merged"] |= vec.merged_segments and not vec.retrained
        did["retrained"] |= vec.retrained
        recalls = []
        for key in rng.sample(sorted(lsm.model), 6):
            query = lsm.model[key]["vec"]
            options = f"named_struct('nprobes', {PARTITIONS}, 'refine_factor', 10)"
            vector = ", ".join(map(str, query))
            sql = f"SELECT id, text, vec, _distance FROM vector_search('t', 'vec', [{vector}], 10, {options})"
            got = ctx.sql(sql).to_arrow_table().to_pylist()
            truth = dict(nearest(lsm.model, query, len(lsm.model)))
            assert key in [r["id"] for r in got if r["_distance"] == 0.0], (key, got)
            for r in got:
                distance = r.pop("_distance")
                assert r == lsm.model[r["id"]], f"stale or deleted row {r}"
                assert distance == pytest.approx(truth[r["id"]], abs=1e-5)
            want = {k for k, _ in nearest(lsm.model, query, 10)}
            recalls.append(len(want & {r["id"] for r in got}) / 10)
        assert np.mean(recalls) >= 0.9, recalls
    assert did == {"merged": True, "retrained": True}
