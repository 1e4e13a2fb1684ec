"""Host-wide uid claims: first free candidate, stale claims taken over, a claim released only by its owner."""

from __future__ import annotations

import os

import pytest

from orchard.env.backends.uid_claims import UidClaims


@pytest.fixture
def owners(tmp_path):
    """Three sandbox directories that exist (live owners) and one that does not (a stale owner)."""
    live = [tmp_path / "root" / name for name in ("a", "b", "c")]
    for d in live:
        d.mkdir(parents=True)
    return [str(d) for d in live], str(tmp_path / "root" / "gone")


def test_claims_go_to_the_first_free_candidate_and_a_claim_is_the_owners_alone(tmp_path, owners):
    (a, b, c), _ = owners
    claims = UidClaims(tmp_path / "claims")
    assert claims.claim_first([10, 11, 12], a) == 10
    assert claims.claim_first([10, 11, 12], b) == 11  # 10 is a's
    assert claims.claim_first([10, 11], c) is None  # both held: nothing is written
    assert not os.path.exists(tmp_path / "claims" / "12")
    assert claims.claim_first([10, 11], a) == 10  # a owner may claim its own uid again
    assert (claims.holder(10), claims.holder(11), claims.holder(12)) == (a, b, None)
    claims.release(10, b)  # not b's: left alone
    assert claims.holder(10) == a
    claims.release(10, a)
    assert claims.holder(10) is None and claims.claim_first([10], c) == 10


def test_a_claim_whose_sandbox_directory_is_gone_is_free(tmp_path, owners):
    (a, b, _), gone = owners
    claims = UidClaims(tmp_path / "claims")
    assert claims.claim_first([7], gone) == 7  # e.g. a create that died before its directory was made
    assert claims.holder(7) is None
    assert claims.claim_first([7], a) == 7 and claims.holder(7) == a
    os.rmdir(a)  # a temporary root_dir removed without deleting its sandboxes
    assert claims.claim_first([7], b) == 7 and claims.holder(7) == b


def test_reclaim_after_a_restart_and_a_second_holder_is_reported(tmp_path, owners):
    (a, b, _), _ = owners
    claims = UidClaims(tmp_path / "claims")
    assert claims.reclaim(5, a) is None and claims.holder(5) == a  # the claim was lost (a new claims dir)
    assert claims.reclaim(5, a) is None  # already its own
    assert claims.reclaim(5, b) == a and claims.holder(5) == a  # held live by a: b is told, nothing written
    # a second object on the same directory (another service) sees the same claims
    assert UidClaims(tmp_path / "claims").claim_first([5, 6], b) == 6


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        UidClaims(5)  # type: ignore[arg-type]
    claims = UidClaims(tmp_path / "claims")
    with pytest.raises(ValueError, match="owner"):
        claims.claim_first([1], "relative/dir")
    with pytest.raises(ValueError, match="owner"):
        claims.release(1, "")
