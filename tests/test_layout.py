"""Storage layout: bit-reversed WAL / manifest file names, generation directory names, region paths."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memwal_df.format import layout

HYP = settings(database=None, deadline=None, max_examples=300)
U64_MAX = 2**64 - 1
REGION = uuid.UUID("11111111-2222-4333-8444-555555555555")


def _reference_name(pos: int) -> str:
    """The formula the format reference gives for the 64 binary digits of a position's file name."""
    return format(int(format(pos, "064b")[::-1], 2), "064b")


# Lance 14's examples of position file names, written out digit by digit.
REFERENCE_EXAMPLES = {
    1: "1" + "0" * 63,
    2: "01" + "0" * 62,
    3: "11" + "0" * 62,
    4: "001" + "0" * 61,
    5: "101" + "0" * 61,
    8: "0001" + "0" * 60,
    2**63: "0" * 63 + "1",
    U64_MAX: "1" * 64,
}


@pytest.mark.parametrize("n", sorted(REFERENCE_EXAMPLES))
@pytest.mark.parametrize("ext", ["arrow", "binpb"])
def test_bitrev_names_of_reference_examples(n: int, ext: str) -> None:
    digits = REFERENCE_EXAMPLES[n]
    assert len(digits) == 64
    assert digits == _reference_name(n)
    name = layout.bitrev64_name(n, ext)
    assert name == f"{digits}.{ext}"
    assert layout.parse_bitrev64_name(name) == n


def test_bitrev_name_of_zero() -> None:
    # 0 is the "nothing covered" sentinel, never a file; the name function still maps it consistently.
    assert layout.bitrev64_name(0, "arrow") == "0" * 64 + ".arrow"
    assert layout.parse_bitrev64_name("0" * 64 + ".arrow") == 0


@HYP
@given(st.integers(0, U64_MAX), st.sampled_from(["arrow", "binpb"]))
def test_bitrev_name_round_trip(n: int, ext: str) -> None:
    name = layout.bitrev64_name(n, ext)
    assert name[:64] == _reference_name(n)
    assert name == f"{name[:64]}.{ext}" and set(name[:64]) <= {"0", "1"}
    assert layout.parse_bitrev64_name(name) == n
    assert int(name[:64][::-1], 2) == n  # the reference's inverse


@HYP
@given(st.text(alphabet="01", min_size=64, max_size=64), st.sampled_from(["arrow", "binpb"]))
def test_every_bitrev_name_parses_back_to_itself(digits: str, ext: str) -> None:
    n = layout.parse_bitrev64_name(f"{digits}.{ext}")
    assert n is not None and 0 <= n <= U64_MAX
    assert layout.bitrev64_name(n, ext) == f"{digits}.{ext}"


@HYP
@given(st.integers(0, U64_MAX), st.integers(0, U64_MAX))
def test_distinct_numbers_have_distinct_names(a: int, b: int) -> None:
    assert (layout.bitrev64_name(a, "arrow") == layout.bitrev64_name(b, "arrow")) == (a == b)


@pytest.mark.parametrize("n", [-1, -(2**63), 2**64, 2**64 + 1, 2**70])
def test_bitrev_name_rejects_out_of_range(n: int) -> None:
    with pytest.raises(ValueError):
        layout.bitrev64_name(n, "arrow")
    with pytest.raises(ValueError):
        layout.wal_path(REGION, n)
    with pytest.raises(ValueError):
        layout.manifest_path(REGION, n)


ONE = "1" + "0" * 63
NOT_BITREV_NAMES = [
    "",
    "version_hint.json",
    ONE,  # no extension
    ONE + ".",
    ONE + ".lance",
    ONE + ".ARROW",
    ONE + ".arrow.tmp",
    ONE + ".binpb.tmp.0f3b6b8e-43c5-4b0a-9a57-1a3c0c6f7d55",  # a LocalStorage temp file
    ONE[:-1] + ".arrow",  # 63 digits
    ONE + "0.arrow",  # 65 digits
    "2" + ONE[1:] + ".arrow",
    " " + ONE + ".arrow",
    ONE + ".arrow ",
    ONE + ".arrow\n",  # `$` in a regex matches before a trailing newline
    ONE + ".binpb\n",
    "wal/" + ONE + ".arrow",
    "１" + ONE[1:] + ".arrow",  # a full-width digit
]


@pytest.mark.parametrize("name", NOT_BITREV_NAMES)
def test_parse_bitrev_rejects_other_names(name: str) -> None:
    assert layout.parse_bitrev64_name(name) is None


def test_paths() -> None:
    base = "_mem_wal/11111111-2222-4333-8444-555555555555"
    assert layout.region_dir(REGION) == base
    assert layout.manifest_path(REGION, 1) == f"{base}/manifest/{ONE}.binpb"
    assert layout.manifest_path(REGION, 3) == f"{base}/manifest/11{'0' * 62}.binpb"
    assert layout.version_hint_path(REGION) == f"{base}/manifest/version_hint.json"
    assert layout.wal_path(REGION, 1) == f"{base}/wal/{ONE}.arrow"
    assert layout.wal_path(REGION, 8) == f"{base}/wal/0001{'0' * 60}.arrow"
    assert layout.generation_path(REGION, "6a718328_gen_1") == f"{base}/6a718328_gen_1"


@pytest.mark.parametrize(
    "form",
    [
        REGION,
        str(REGION),
        str(REGION).upper(),
        "{" + str(REGION) + "}",
        "urn:uuid:" + str(REGION),
        REGION.hex,
    ],
)
def test_region_dir_normalizes_uuid_spellings(form: object) -> None:
    # Lance names shard directories with the hyphenated lower-case form.
    assert layout.region_dir(form) == f"_mem_wal/{REGION}"
    assert layout.wal_path(form, 2) == layout.wal_path(REGION, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["", "not-a-uuid", "11111111-2222-4333-8444-55555555555"])
def test_region_dir_rejects_non_uuids(bad: str) -> None:
    with pytest.raises(ValueError):
        layout.region_dir(bad)


# ------------------------------------------------------------------ generation directories


@pytest.mark.parametrize(
    ("prefix", "generation", "name"),
    [
        ("6a718328", 1, "6a718328_gen_1"),
        ("00000000", 2, "00000000_gen_2"),
        ("ffffffff", 10, "ffffffff_gen_10"),
        ("0a1b2c3d", U64_MAX, f"0a1b2c3d_gen_{U64_MAX}"),
    ],
)
def test_generation_dir_names(prefix: str, generation: int, name: str) -> None:
    assert layout.generation_dir_name(prefix, generation) == name
    assert layout.parse_generation_dir_name(name) == (prefix, generation)


@HYP
@given(st.binary(min_size=4, max_size=4), st.integers(0, U64_MAX))
def test_generation_dir_name_round_trip(raw: bytes, generation: int) -> None:
    prefix = raw.hex()  # what secrets.token_hex(4) gives
    name = layout.generation_dir_name(prefix, generation)
    assert layout.parse_generation_dir_name(name) == (prefix, generation)


@HYP
@given(st.text(alphabet="0123456789abcdefABCDEF_gen-x\n٣ ", max_size=20))
def test_parsed_generation_dir_names_round_trip(name: str) -> None:
    parsed = layout.parse_generation_dir_name(name)
    if parsed is not None:
        assert layout.generation_dir_name(*parsed) == name


@pytest.mark.parametrize(
    "prefix", ["6A718328", "6a71832", "6a7183281", "6a71832g", "", " 6a71832", "6a718328\n"]
)
def test_generation_dir_name_rejects_bad_prefixes(prefix: str) -> None:
    with pytest.raises(ValueError):
        layout.generation_dir_name(prefix, 1)


@pytest.mark.parametrize("generation", [-1, 2**64])
def test_generation_dir_name_rejects_bad_generations(generation: int) -> None:
    with pytest.raises(ValueError):
        layout.generation_dir_name("6a718328", generation)


@pytest.mark.parametrize(
    "name",
    [
        "manifest",
        "wal",
        "_pk_index",
        "6a718328_gen_",
        "_gen_1",
        "6A718328_gen_1",
        "6a71832_gen_1",
        "6a718328_gen_x",
        "6a718328_gen_-1",
        "6a718328_gen_1\n",
        "6a718328_gen_1/",
        "6a718328_gen_01",  # not a name Lance writes: would alias generation 1
        "6a718328_gen_٣",  # an Arabic-Indic digit: int() would accept it
        "6a718328-gen-1",
        f"6a718328_gen_{2**64}",  # not a u64: no manifest could list it
    ],
)
def test_parse_generation_dir_name_rejects_other_names(name: str) -> None:
    assert layout.parse_generation_dir_name(name) is None
