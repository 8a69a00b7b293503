"""Claims: one computation per configuration across concurrent runners, and no RUNNING debris.

MLflow has no compare-and-set, so a runner *claims* a run before computing it with a protocol that
needs only reads and writes of runs (Lamport's bakery, over MLflow runs):

1. create the run, status RUNNING, tagged ``config_hash``, ``claim.owner`` (host:pid:process
   start), ``claim.lease_until`` and ``claim.state = choosing``;
2. read the other live claims of that hash and take ``claim.ticket`` = 1 + their largest ticket,
   then ``claim.state = chosen``;
3. wait while a live claim is still choosing, then re-read: the live claim with the smallest
   ``(ticket, run id)`` wins; every other claimant marks its own run KILLED (``claim.state =
   lost``, tag ``failure_reason``), deletes it and leaves that configuration to the winner. A
   FINISHED run of the hash makes every claimant lose. No lost claim stays RUNNING, even in
   MLflow's views of deleted runs.

Two claims that overlap in time always see each other at step 3 and agree on the winner, so a
configuration is computed once whatever the number of runners (on one machine, several machines on
one tracking server, or a Ray cluster: only the parent process claims).

A claim is *live* while its lease runs (``claim.lease_until``, renewed every ``lease_s / 4`` s by
a heartbeat thread of its owner) and, on the owner's own host, while the owner process exists.
:meth:`ClaimBook.reap_stale` marks the RUNNING runs of dead owners KILLED (tag
``failure_reason``), so the next sweep recomputes them; claims left by a kill -9 on this host are
reaped at once, those of another machine when their lease has expired.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass

from mlflow.entities import RunTag, ViewType

from benchmarks.store import mlflow_ui as ui
from benchmarks.store.tracking import Tracker

LEASE_S = 60.0
"""Default lease of a claim (seconds): how long a claim outlives its owner on another machine."""
OWNER, LEASE, STATE, TICKET = "claim.owner", "claim.lease_until", "claim.state", "claim.ticket"
CHOOSING_WAIT_S = 0.05
LOST = "lost"
"""``claim.state`` of a claim that lost the race: KILLED and deleted."""


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, Linux), "" where unknown, None if
    no such process: with the pid it names one process, even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return ""


def this_owner() -> str:
    """``host:pid:start`` of this process, the value of ``claim.owner``."""
    return f"{socket.gethostname()}:{os.getpid()}:{_process_start(os.getpid()) or ''}"


def owner_dead(owner: str) -> bool:
    """True when ``owner`` (a ``claim.owner`` value) is a process of this host that no longer exists."""
    host, _, rest = owner.partition(":")
    pid, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    now = _process_start(int(pid))
    return now is None or bool(start and now and now != start)


@dataclass
class Claim:
    """What a runner reads of a run of the hash it claims."""

    run_id: str
    status: str
    owner: str
    lease_until: float
    state: str
    ticket: int

    @classmethod
    def of(cls, run) -> "Claim":
        tags = run.data.tags
        return cls(run.info.run_id, run.info.status, tags.get(OWNER, ""), float(tags.get(LEASE, 0) or 0),
                   tags.get(STATE, ""), int(tags.get(TICKET, 0) or 0))

    def stale(self, now: float) -> bool:
        """A RUNNING run whose owner is gone: lease expired (or none, written before claims
        existed), or its owner a dead process of this host."""
        return self.status == "RUNNING" and (self.lease_until < now or owner_dead(self.owner))

    def live(self, now: float) -> bool:
        return self.status == "RUNNING" and not self.stale(now)


class ClaimBook:
    """The claims one runner holds in one suite's experiment, with their heartbeat."""

    def __init__(self, tracker: Tracker, suite_key: str, lease_s: float = LEASE_S):
        if lease_s <= 0:
            raise ValueError(f"--lease must be > 0 seconds, got {lease_s}")
        self.tracker, self.client, self.suite_key, self.lease_s = tracker, tracker.client, suite_key, lease_s
        self.owner = this_owner()
        self.held: dict[str, str] = {}  # run id -> config hash
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    # -- reading --------------------------------------------------------------------------------
    def _runs_of(self, config_hash: str) -> list:
        exp = self.tracker.experiment_id(self.suite_key)
        return self.client.search_runs([exp], f"tags.config_hash = '{config_hash}'", max_results=1000)

    def reap_stale(self) -> list[str]:
        """Mark KILLED every RUNNING run of the suite whose owner is gone (see :meth:`Claim.stale`);
        return their config hashes. The next claim of those hashes recomputes them."""
        now, reaped = time.time(), []
        self._kill_deleted_claims(now)
        for run in self.tracker.runs(self.suite_key, status="RUNNING"):
            claim = Claim.of(run)
            if run.data.tags.get("config_hash") and claim.stale(now):
                self._kill(claim, "stale")
                reaped.append(run.data.tags["config_hash"])
        for run in self.tracker.runs(self.suite_key, status="RUNNING", kind=ui.SWEEP):
            owner = run.data.tags.get(OWNER, "")
            if owner and owner_dead(owner):  # a sweep's parent run whose runner was killed (-9)
                self.client.set_tag(run.info.run_id, "failure_reason",
                                    f"sweep left RUNNING by {owner}, a process that died; marked KILLED by {self.owner}")
                self.client.set_terminated(run.info.run_id, status="KILLED")
        return reaped

    def _kill_deleted_claims(self, now: float) -> None:
        """Mark KILLED the deleted claims still RUNNING whose owner is gone (lost claims of
        versions that deleted them without marking them)."""
        exp = self.tracker.experiment_id(self.suite_key, create=False)
        if exp is None:
            return
        for run in self.client.search_runs([exp], "attributes.status = 'RUNNING'", ViewType.DELETED_ONLY,
                                           max_results=5000):
            claim = Claim.of(run)
            if claim.stale(now):  # MLflow writes only active runs: restored, marked, deleted again
                self.client.restore_run(claim.run_id)
                self.client.set_tag(claim.run_id, STATE, LOST)
                self._kill(claim, "lost claim")
                self.client.delete_run(claim.run_id)

    def own_sweep(self, run_id: str) -> None:
        """Tag a sweep's parent run with this runner as its owner, so that the next start on this
        host marks it KILLED (:meth:`reap_stale`) if this process dies before closing it."""
        self.client.set_tag(run_id, OWNER, self.owner)

    def _kill(self, claim: Claim, why: str) -> None:
        owner = claim.owner or "a runner without claims"
        reason = (f"{why}: left RUNNING by {owner} (lease until {time.ctime(claim.lease_until)}); marked "
                  f"KILLED by {self.owner}; the next sweep recomputes it")
        self.client.set_tag(claim.run_id, "failure_reason", reason)
        self.client.set_terminated(claim.run_id, status="KILLED")

    # -- claiming -------------------------------------------------------------------------------
    def claim(self, config_hash: str, tags: dict[str, str]) -> str | None:
        """Claim ``config_hash``: the run id of our RUNNING claim (tagged ``tags``) when we won,
        None when it FINISHED already or another live claim won (our claim run is deleted)."""
        exp = self.tracker.experiment_id(self.suite_key)
        mine = self.client.create_run(exp, start_time=int(time.time() * 1000), tags={
            **tags, "config_hash": config_hash, OWNER: self.owner, LEASE: repr(time.time() + self.lease_s),
            STATE: "choosing"}).info.run_id
        with self._lock:
            self.held[mine] = config_hash
        self._start_heartbeat()
        others = self._others(config_hash, mine)
        if others is None:
            return self._lose(mine)
        ticket = 1 + max((c.ticket for c in others if c.state == "chosen"), default=0)
        self.client.set_tag(mine, TICKET, str(ticket))
        self.client.set_tag(mine, STATE, "chosen")
        while True:
            others = self._others(config_hash, mine)
            if others is None:
                return self._lose(mine)
            if any(c.state != "chosen" for c in others):
                time.sleep(CHOOSING_WAIT_S)
                continue
            if any((c.ticket, c.run_id) < (ticket, mine) for c in others):
                return self._lose(mine)
            return mine

    def _others(self, config_hash: str, mine: str) -> list[Claim] | None:
        """The other live claims of the hash; None when the hash has a FINISHED run. Stale
        claims met on the way are marked KILLED."""
        now, live = time.time(), []
        for run in self._runs_of(config_hash):
            claim = Claim.of(run)
            if claim.run_id == mine:
                continue
            if claim.status == "FINISHED":
                return None
            if claim.stale(now):
                self._kill(claim, "stale")
            elif claim.live(now):
                live.append(claim)
        return live

    def _lose(self, mine: str) -> None:
        """Give the hash up: our claim run is marked KILLED (``claim.state = lost``), then deleted."""
        with self._lock:
            self.held.pop(mine, None)
        self.client.log_batch(mine, tags=[RunTag(STATE, LOST), RunTag(
            "failure_reason", f"lost claim: another runner computes this configuration; deleted by {self.owner}")])
        self.client.set_terminated(mine, status="KILLED")
        self.client.delete_run(mine)
        return None

    # -- holding and giving back ----------------------------------------------------------------
    def done(self, run_id: str) -> None:
        """The claim's run was written FINISHED or FAILED: stop renewing its lease."""
        with self._lock:
            self.held.pop(run_id, None)

    def release_all(self, reason: str, status: str = "KILLED") -> int:
        """Mark every held claim ``status`` (KILLED: an interruption; FAILED: an error such as a full
        disk) with ``reason``; return how many."""
        with self._lock:
            held, self.held = dict(self.held), {}
        for run_id in held:
            self.client.set_tag(run_id, "failure_reason", reason)
            self.client.set_terminated(run_id, status=status)
        return len(held)

    def close(self) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join()

    def _start_heartbeat(self) -> None:
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeat, name="claim-heartbeat", daemon=True)
            self._beat.start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 4):
            with self._lock:
                held = list(self.held)
            until = repr(time.time() + self.lease_s)
            for run_id in held:
                try:
                    self.client.log_batch(run_id, tags=[RunTag(LEASE, until)])
                except Exception:  # noqa: BLE001 - a run finished meanwhile, or the store hiccuped: next beat
                    pass
