"""Host-wide uid claims: first free candidate, stale claims taken over, a claim released only by its owner."""

from __future__ import annotations

import os
import subprocess

import pytest
from _box import needs_root

from orchard.env.backends.uid_claims import UidClaims

U = 3_100_000
"""The uids these tests claim: far above any account's or sandbox's, so no process runs as them."""


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
    assert claims.claim_first([U, U + 1, U + 2], a) == U
    assert claims.claim_first([U, U + 1, U + 2], b) == U + 1  # U is a's
    assert claims.claim_first([U, U + 1], c) is None  # both held: nothing is written
    assert not os.path.exists(tmp_path / "claims" / str(U + 2))
    assert claims.claim_first([U, U + 1], a) == U  # an owner may claim its own uid again
    assert (claims.holder(U), claims.holder(U + 1), claims.holder(U + 2)) == (a, b, None)
    claims.release(U, b)  # not b's: left alone
    assert claims.holder(U) == a
    claims.release(U, a)
    assert claims.holder(U) is None and claims.claim_first([U], c) == U


def test_a_claim_whose_sandbox_directory_is_gone_is_free(tmp_path, owners):
    (a, b, _), gone = owners
    claims = UidClaims(tmp_path / "claims")
    assert claims.claim_first([U + 7], gone) == U + 7  # e.g. a create that died before its directory was made
    assert claims.holder(U + 7) is None
    assert claims.claim_first([U + 7], a) == U + 7 and claims.holder(U + 7) == a
    os.rmdir(a)  # a temporary root_dir removed without deleting its sandboxes
    assert claims.claim_first([U + 7], b) == U + 7 and claims.holder(U + 7) == b


def test_reclaim_after_a_restart_and_a_second_holder_is_reported(tmp_path, owners):
    (a, b, _), _ = owners
    claims = UidClaims(tmp_path / "claims")
    assert claims.reclaim(U + 5, a) is None and claims.holder(U + 5) == a  # the claim was lost (a new claims dir)
    assert claims.reclaim(U + 5, a) is None  # already its own
    assert claims.reclaim(U + 5, b) == a and claims.holder(U + 5) == a  # held live by a: b is told, nothing written
    # a second object on the same directory (another service) sees the same claims
    assert UidClaims(tmp_path / "claims").claim_first([U + 5, U + 6], b) == U + 6


@needs_root
def test_a_uid_a_process_runs_as_is_not_free(tmp_path, owners):
    # a sandbox of a service that does not claim (an older version): its process is the only sign of it
    (a, _, _), _ = owners
    proc = subprocess.Popen(["sleep", "60"], user=U + 8, group=U + 8)
    try:
        claims = UidClaims(tmp_path / "claims")
        assert U + 8 in claims.running_uids()
        assert claims.claim_first([U + 8, U + 9], a) == U + 9
    finally:
        proc.kill()
        proc.wait()


def test_validation(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        UidClaims(5)  # type: ignore[arg-type]
    claims = UidClaims(tmp_path / "claims")
    with pytest.raises(ValueError, match="owner"):
        claims.claim_first([1], "relative/dir")
    with pytest.raises(ValueError, match="owner"):
        claims.release(1, "")
