"""DNS discovery's decisions: members from A/AAAA and SRV answers, keeping the last members on a
failed or empty lookup, the next lookup's delay from the TTL."""

from __future__ import annotations

import pytest

from gateway.core.dnsmembers import (
    Found,
    SrvRecord,
    address,
    from_addresses,
    from_srv,
    judge,
    next_delay,
)


def test_addresses_become_members_on_the_port() -> None:
    got = from_addresses(["10.0.0.2", "fd00::1", "10.0.0.1", "10.0.0.2"], 8000, 2, 1, 10)
    assert list(got) == ["10.0.0.1:8000", "10.0.0.2:8000", "[fd00::1]:8000"]
    assert set(got.values()) == {Found(2, 1)}
    assert len(from_addresses([f"10.0.0.{i}" for i in range(9)], 80, 1, 0, 4)) == 4
    assert address("::1", 53) == "[::1]:53"


def test_srv_records_give_ports_weights_and_levels() -> None:
    recs = [SrvRecord(20, 5, 9000, ("10.0.0.3",)), SrvRecord(10, 0, 8000, ("10.0.0.1", "10.0.0.2")),
            SrvRecord(10, 3, 8001, ("10.0.0.1",)), SrvRecord(99, 1, 1, ("10.0.0.9",))]  # fmt: skip
    got = from_srv(recs, 10)
    assert got == {
        "10.0.0.1:8001": Found(3, 0), "10.0.0.1:8000": Found(1, 0), "10.0.0.2:8000": Found(1, 0),
        "10.0.0.3:9000": Found(5, 1), "10.0.0.9:1": Found(1, 2),
    }  # fmt: skip
    assert len(from_srv(recs, 2)) == 2


def test_a_failed_or_empty_answer_keeps_the_last_members() -> None:
    last = {"10.0.0.1:80": Found(1, 0)}
    assert judge(last, None) == judge(last, {}) == type(judge(last, None))(last, True, False)
    new = {"10.0.0.2:80": Found(1, 0)}
    j = judge(last, new)
    assert j.members == new and not j.kept and j.changed
    assert not judge(new, dict(new)).changed


@pytest.mark.parametrize(
    ("ttl", "interval", "failed", "delay"),
    [(30.0, 5.0, False, 5.0), (2.0, 5.0, False, 2.0), (0.0, 5.0, False, 1.0),
     (None, 5.0, False, 5.0), (None, 5.0, True, 1.0), (None, 0.5, True, 0.5),
     (0.0, 0.5, False, 0.5)],
)  # fmt: skip
def test_next_lookup_honours_the_ttl_below_the_interval(
    ttl: float | None, interval: float, failed: bool, delay: float
) -> None:
    assert next_delay(ttl, interval, failed) == delay
