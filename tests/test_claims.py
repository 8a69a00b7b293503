"""benchmarks.store.claims: the claim protocol and stale runs, on real MLflow SQLite stores in tmp_path."""
from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest

import benchmarks.running.sweep as runner
from benchmarks.store.claims import LEASE, OWNER, ClaimBook, owner_dead, this_owner
from benchmarks.running.sweep import run_sweep
from benchmarks.suite.spec import load_suite
from benchmarks.store.tracking import Tracker
from conftest import store, tiny_suite_dict, write_suite

KEY = "tiny/mini"


def quiet(*_args, **_kwargs):
    pass


@pytest.fixture(autouse=True)
def _isolated(isolated):
    return isolated


@pytest.fixture
def tracker(tmp_path):
    return Tracker(*store(tmp_path / "store"))


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_first_claim_wins_later_ones_lose_and_delete_their_run(tracker):
    first, second = ClaimBook(tracker, KEY), ClaimBook(tracker, KEY)
    try:
        won = first.claim("h1", {"cell": "c"})
        assert won is not None
        assert second.claim("h1", {"cell": "c"}) is None
        runs = tracker.runs(KEY, status=None)  # the loser's run is deleted (not listed)
        assert [r.info.run_id for r in runs] == [won]
        assert runs[0].data.tags["claim.state"] == "chosen" and runs[0].data.tags[OWNER] == this_owner()
        assert float(runs[0].data.tags[LEASE]) > time.time()
        # another hash is free
        assert second.claim("h2", {}) is not None
        # once FINISHED, nobody claims it again
        tracker.client.set_terminated(won, status="FINISHED")
        first.done(won)
        assert ClaimBook(tracker, KEY).claim("h1", {}) is None
    finally:
        first.close()
        second.close()


def test_heartbeat_renews_the_lease(tracker):
    book = ClaimBook(tracker, KEY, lease_s=0.8)
    try:
        run_id = book.claim("h", {})
        first = float(tracker.client.get_run(run_id).data.tags[LEASE])
        time.sleep(1.0)
        assert float(tracker.client.get_run(run_id).data.tags[LEASE]) > first
    finally:
        book.close()


def _orphan(tracker, owner: str, lease_until: float, config_hash: str = "h") -> str:
    exp = tracker.experiment_id(KEY)
    return tracker.client.create_run(exp, tags={"config_hash": config_hash, OWNER: owner,
                                                LEASE: repr(lease_until), "claim.state": "chosen",
                                                "claim.ticket": "1"}).info.run_id


def test_stale_claims_are_killed_live_ones_respected(tracker):
    host = socket.gethostname()
    dead_here = _orphan(tracker, f"{host}:{dead_pid()}:", time.time() + 3600, "a")  # kill -9 on this host
    expired = _orphan(tracker, "elsewhere:1:", time.time() - 1, "b")  # another machine, lease over
    legacy = tracker.client.create_run(tracker.experiment_id(KEY), tags={"config_hash": "c"}).info.run_id
    live = _orphan(tracker, "elsewhere:1:", time.time() + 3600, "d")  # another machine, lease running
    parent = tracker.client.create_run(tracker.experiment_id(KEY), tags={"kind": "sweep"}).info.run_id
    book = ClaimBook(tracker, KEY)
    try:
        assert sorted(book.reap_stale()) == ["a", "b", "c"]
        status = {r.info.run_id: r.info.status for r in tracker.runs(KEY, status=None)}
        assert status == {dead_here: "KILLED", expired: "KILLED", legacy: "KILLED", live: "RUNNING",
                          parent: "RUNNING"}  # a run without config_hash (a sweep's parent run) is not a claim
        reason = tracker.client.get_run(dead_here).data.tags["failure_reason"]
        assert reason.startswith(f"stale: left RUNNING by {host}:") and "recomputes" in reason
        assert book.claim("d", {}) is None  # a live claim of another runner wins
        assert book.claim("a", {}) is not None  # a reaped one is free again
    finally:
        book.close()


def test_owner_dead_only_for_processes_of_this_host():
    host = socket.gethostname()
    assert owner_dead(f"{host}:{dead_pid()}:")
    assert not owner_dead(this_owner())
    assert not owner_dead(f"{host}:{os.getpid()}:")  # start time unknown: the pid alone
    assert owner_dead(f"{host}:{os.getpid()}:1")  # same pid, another process start: pid reused
    assert not owner_dead(f"not-{host}:{dead_pid()}:")


def test_stale_run_of_a_dead_runner_is_killed_and_recomputed_by_the_next_sweep(tmp_path, tracker):
    suite = load_suite(write_suite(tmp_path / "mini.yaml", tiny_suite_dict()))
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["iid"], "method": ["local", "fedavg"]})
    stuck = _orphan(tracker, f"{socket.gethostname()}:{dead_pid()}:", time.time() + 3600, specs[0].config_hash)
    messages = []
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=messages.append)
    assert (summary.finished, summary.failed) == (2, 0)
    assert any("1 run(s) left RUNNING by a runner that died marked KILLED" in m for m in messages)
    runs = tracker.runs(KEY, status=None)
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED", "KILLED"]
    assert next(r for r in runs if r.info.run_id == stuck).info.status == "KILLED"
    assert {r.data.tags["config_hash"] for r in runs if r.info.status == "FINISHED"} == {s.config_hash for s in specs}


def test_a_config_listed_twice_runs_once(tmp_path, tracker):
    """Load-time validation rejects a seed listed twice (tests/test_bad_inputs.py), and a cut-down
    profile may still map two cells to one configuration: the runner runs each config hash once."""
    suite = load_suite(write_suite(tmp_path / "mini.yaml", tiny_suite_dict()))
    (spec,) = suite.expand("smoke", seeds=[0], only={"setting": ["iid"], "method": ["local"]})
    specs = [spec, spec]  # the same configuration twice
    messages = []
    summary = run_sweep(suite, specs, tracker, device="cpu", echo=messages.append)
    assert (summary.finished, summary.skipped) == (1, 1)
    assert any("1 duplicate run(s)" in m for m in messages)
    assert len(tracker.runs(KEY, status=None)) == 1


def test_a_run_claimed_by_another_live_runner_is_left_to_it(tmp_path, tracker):
    suite = load_suite(write_suite(tmp_path / "mini.yaml", tiny_suite_dict()))
    specs = suite.expand("smoke", seeds=[0], only={"setting": ["iid"], "method": ["local", "fedavg"]})
    other = ClaimBook(tracker, KEY)
    try:
        theirs = other.claim(specs[1].config_hash, {})
        summary = run_sweep(suite, specs, tracker, device="cpu", echo=quiet)
        assert (summary.finished, summary.elsewhere) == (1, 1)
        assert tracker.client.get_run(theirs).info.status == "RUNNING"  # untouched: its owner lives
    finally:
        other.close()


def _running_anywhere(tracker) -> list:
    """RUNNING runs of the suite's experiment, deleted ones included (MLflow's "all runs" views)."""
    from mlflow.entities import ViewType

    exp = tracker.experiment_id(KEY, create=False)
    return tracker.client.search_runs([exp], "attributes.status = 'RUNNING'", ViewType.ALL)


def test_a_lost_claim_is_marked_killed_and_deleted_so_no_running_run_remains(tracker):
    first, second = ClaimBook(tracker, KEY), ClaimBook(tracker, KEY)
    try:
        won = first.claim("h1", {"cell": "c"})
        assert second.claim("h1", {"cell": "c"}) is None
        tracker.client.set_terminated(won, status="FINISHED")
        first.done(won)
        assert _running_anywhere(tracker) == []
        from mlflow.entities import ViewType

        (lost,) = tracker.client.search_runs([tracker.experiment_id(KEY)], "", ViewType.DELETED_ONLY)
        assert lost.info.status == "KILLED" and lost.data.tags["claim.state"] == "lost"
        assert lost.data.tags["failure_reason"].startswith("lost claim")
    finally:
        first.close()
        second.close()


def test_deleted_claims_left_running_by_older_versions_are_killed_at_the_next_start(tracker):
    exp = tracker.experiment_id(KEY)
    owner = f"{socket.gethostname()}:{dead_pid()}:1"
    debris = tracker.client.create_run(exp, tags={"config_hash": "h1", OWNER: owner, LEASE: "0"}).info.run_id
    tracker.client.delete_run(debris)  # what a lost claim was before: deleted, still RUNNING
    ClaimBook(tracker, KEY).reap_stale()
    assert _running_anywhere(tracker) == []
    assert tracker.client.get_run(debris).data.tags["claim.state"] == "lost"
    assert tracker.client.get_run(debris).info.lifecycle_stage == "deleted"
