"""Issue 15's proof on the Kubernetes backend: two replicas (`orchard env serve --backend kubernetes --store
redis://...`, separate processes) behind one address, sandboxes x 4 execs through it, one replica SIGKILLed
mid-run. CI size: 20 sandboxes (`ORCHARD_K8S_REPLICA_SANDBOXES`); `benchmarks/env_k8s.py` runs 200."""

from __future__ import annotations

import asyncio
import os

import pytest
from conftest import NAMESPACE, Cluster
from k8s_replicas import replica_kill_run, two_replicas

SANDBOXES = int(os.environ.get("ORCHARD_K8S_REPLICA_SANDBOXES", "20"))
EXECS = 4


@pytest.mark.slow
def test_a_killed_replica_loses_no_sandbox_and_no_exec_runs_twice(cluster: Cluster, redis_url, tmp_path):
    store = redis_url.rsplit("/", 1)[0] + "/5"  # a database of its own: the replicas use the default prefix
    with two_replicas(cluster.api.url, NAMESPACE, store, "replica-key", tmp_path) as (a, b, front):
        report = asyncio.run(replica_kill_run(a, b, front, "replica-key", store, sandboxes=SANDBOXES,
                                              execs=EXECS))
        assert a.process.returncode == -9 and b.process.poll() is None  # A died by SIGKILL; B lives
        assert front.connections[0] > 0 and front.connections[1] > 0  # the front used both
    assert report.problems() == [], f"agents that exited on their own: {cluster.kubelet.exits}"
    counts = report.counts()
    # every exec is accounted for: 20 sandboxes x 4 execs = 80, each answered ok or reported lost
    assert counts["ok"] + counts["lost"] == SANDBOXES * EXECS and counts["error"] == 0
    assert report.listed_after == report.sandboxes  # none lost; all read and deleted through B afterwards
    # both replicas ran execs; the kill came after a quarter (80 // 4 = 20) were answered: the other 60 B ran,
    # or A had them in hand when it died and B reported them lost
    after_kill = SANDBOXES * EXECS - report.answered_before_kill
    assert report.ran_by["a"] > 0 and report.ran_by["b"] + counts["lost"] >= after_kill
    assert cluster.leftovers() == {}  # no pod, Secret, NetworkPolicy or agent process left
