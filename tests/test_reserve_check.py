"""labkit.course.reserve: the policy file and the lease checker (every violation code, DST, malformed rows)."""
from __future__ import annotations

import copy
import csv
import datetime as dt
from pathlib import Path

import pytest
import yaml

from labkit.errors import ReservationError
from labkit.course.reserve import CODES, Lease, check_leases, check_rows, load_policy, read_rows
from labkit.course.reserve.policy import policy_from_dict

ROOT = Path(__file__).resolve().parent.parent
POLICY_FILE = ROOT / "reservations" / "policy.yaml"
CORPUS = Path(__file__).resolve().parent / "data" / "reserve" / "leases_every_code.csv"


@pytest.fixture(scope="module")
def policy():
    return load_policy(POLICY_FILE)


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load(POLICY_FILE.read_text())


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text)


# ---------------------------------------------------------------- the policy file
def test_policy_ships_the_seed_node_set_zone_and_dates(policy):
    assert policy.timezone == "America/New_York"
    assert {n.name for n in policy.nodes} == {"307G3Q3", "gigaio-compute-02", "gigaio-compute-03",
                                              "gigaio-compute-07", "JOBG3Q3", "P3-GPU-009", "P3-GPU-012"}
    assert policy.pool_of("307G3Q3").hours == 3 and policy.pool_of("gigaio-compute-07").hours == 2
    assert policy.node("P3-GPU-012").node_type == "gpu_v100"
    assert {n.available_from for n in policy.nodes if n.name != "307G3Q3"} == {dt.date(2025, 2, 20)}
    assert policy.deadline == dt.datetime(2025, 2, 27, 23, 59, tzinfo=policy.tz)
    assert dict(policy.patterns) == {"one_block": ("course_a100x4",), "two_blocks": ("single_a100", "multi_gpu")}


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(timezone="Mars/Olympus"), "Mars/Olympus"),
    (lambda d: d["overnight"].update(start=60), "quoted"),
    (lambda d: d["nodes"]["307G3Q3"].update(pool="nope"), "nope"),
    (lambda d: d.update(colour="blue"), "colour"),
    (lambda d: d["term"].update(deadline="2025-01-01T00:00"), "before term.start"),
    (lambda d: d["daytime_patterns"].pop("two_blocks"), "single_a100"),
])
def test_bad_policy_names_the_key(raw, mutate, needle):
    data = copy.deepcopy(raw)
    mutate(data)
    with pytest.raises(ReservationError, match=needle):
        policy_from_dict(data)


# ---------------------------------------------------------------- the corpus: every code
def test_corpus_rows_get_exactly_their_expected_codes(policy):
    rows = read_rows(CORPUS, tz_hint=policy.tz)
    found = check_rows(rows, policy)
    got: dict[int, set[str]] = {}
    for v in found:
        got.setdefault(v.row, set()).add(v.code)
    with CORPUS.open() as f:
        expected = {line: set(rec["expect"].split()) for line, rec in enumerate(csv.DictReader(f), start=2)}
    assert {k: v for k, v in expected.items() if v} == got
    assert {v.code for v in found} == set(CODES)


def test_overlap_names_the_other_user_on_both_sides(policy):
    found = check_rows(read_rows(CORPUS, tz_hint=policy.tz), policy)
    by_user = {v.user: v.message for v in found if v.code == "overlap" and v.node == "307G3Q3"}
    assert "dan" in by_user["cat"] and "cat" in by_user["dan"]


def test_malformed_naive_time_message_gives_the_fix(policy):
    found = check_rows(read_rows(CORPUS, tz_hint=policy.tz), policy)
    naive = next(v for v in found if v.user == "oz")
    assert "2025-02-25T14:00:00-05:00" in naive.message and "UTC offset" in naive.message


def test_quota_flags_the_later_extra_and_overnight_extras_are_free(policy):
    def lease(start, end, node="307G3Q3"):
        return Lease("zoe", node, at(start), at(end))
    first = lease("2025-02-14T08:00-05:00", "2025-02-14T10:55-05:00")
    night = lease("2025-02-15T01:00-05:00", "2025-02-15T03:55-05:00")
    night2 = lease("2025-02-16T04:00-05:00", "2025-02-16T06:55-05:00")
    extra = lease("2025-02-17T08:00-05:00", "2025-02-17T10:55-05:00")
    assert check_leases([first, night, night2], policy) == []
    found = check_leases([extra, first, night], policy)
    assert [(v.code, v.start) for v in found] == [("daytime_quota", extra.start.isoformat())]


def test_unreadable_files_raise(tmp_path, policy):
    with pytest.raises(ReservationError, match="cannot read"):
        read_rows(tmp_path / "missing.csv")
    wrong = tmp_path / "wrong.csv"
    wrong.write_text("who,where\nalice,307G3Q3\n")
    with pytest.raises(ReservationError, match="no column"):
        read_rows(wrong)


# ---------------------------------------------------------------- time zones
def test_durations_are_absolute_across_the_spring_forward(raw):
    """01:00 EST -> 04:55 EDT on 2025-03-09 is 2h55m of real time: a legal overnight 3-h block."""
    data = copy.deepcopy(raw)
    data["term"] = {"start": "2025-03-01", "deadline": "2025-03-20T23:59"}
    policy = policy_from_dict(data)
    lease = Lease("ann", "307G3Q3", at("2025-03-09T01:00-05:00"), at("2025-03-09T04:55-04:00"))
    assert policy.is_overnight(lease.start, lease.end)
    assert check_leases([lease], policy) == []
    longer = Lease("ann", "307G3Q3", at("2025-03-09T01:00-05:00"), at("2025-03-09T05:55-04:00"))
    assert [v.code for v in check_leases([longer], policy)] == ["too_long"]


def test_overnight_window_follows_daylight_saving(policy):
    """05:00Z-07:55Z is 01:00-03:55 in July (EDT) but 00:00-02:55 in January (EST)."""
    assert policy.is_overnight(at("2025-07-01T05:00Z"), at("2025-07-01T07:55Z"))
    assert not policy.is_overnight(at("2025-01-15T05:00Z"), at("2025-01-15T07:55Z"))


def test_on_the_hour_is_read_in_the_policy_zone(raw):
    data = copy.deepcopy(raw)
    data["timezone"] = "Asia/Kolkata"  # UTC+05:30: 14:00Z is 19:30 there
    policy = policy_from_dict(data)
    lease = Lease("raj", "307G3Q3", at("2025-02-14T14:00Z"), at("2025-02-14T16:55Z"))
    assert {v.code for v in check_leases([lease], policy)} == {"not_on_hour", "bad_end"}
