"""Committed micro-batches of streaming queries (`memwal_df.format.stream_commits`) on local storage."""

from __future__ import annotations

import uuid

import pytest

from memwal_df.errors import InvalidArgumentError
from memwal_df.format import layout, stream_commits
from memwal_df.format.open_storage import open_storage


def test_record_committed_and_prune(tmp_path):
    storage = open_storage(str(tmp_path))
    query, other = str(uuid.uuid4()), str(uuid.uuid4())
    assert stream_commits.last_committed(storage, query) is None
    assert not stream_commits.committed(storage, query, 0)
    for batch in range(5):
        assert stream_commits.record(storage, query, batch, rows=10, regions=2)
    assert not stream_commits.record(storage, query, 4, rows=10, regions=2)  # a replayed commit
    stream_commits.record(storage, other, 0, rows=1, regions=1)
    assert stream_commits.batches(storage, query) == [0, 1, 2, 3, 4]
    assert stream_commits.prune(storage, query, keep=2) == [0, 1, 2]
    assert stream_commits.batches(storage, query) == [3, 4]
    # pruning changes no answer: a query commits its batches in order
    assert [stream_commits.committed(storage, query, b) for b in range(7)] == [True] * 5 + [False] * 2
    assert stream_commits.batches(storage, other) == [0]
    assert sorted(storage.list_dir(layout.STREAMS_DIR)) == sorted([query, other])


def test_query_ids_and_batches_are_checked(tmp_path):
    storage = open_storage(str(tmp_path))
    query = str(uuid.uuid4())
    assert stream_commits.query_id(query.upper()) == query
    for bad in ("../x", "", None):
        with pytest.raises(InvalidArgumentError, match="UUID"):
            stream_commits.query_id(bad)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        stream_commits.record(storage, query, -1, rows=0, regions=0)
    with pytest.raises(InvalidArgumentError, match="keep"):
        stream_commits.prune(storage, query, keep=0)
    assert storage.list_dir(layout.STREAMS_DIR) == []
