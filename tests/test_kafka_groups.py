"""Group coordinator state machine: rebalances, generations, timeouts — no sockets, fake clock."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from store.kafka.groups import GroupCoordinator, GroupState, JoinResult, SyncResult

NONE, UNKNOWN_MEMBER, ILLEGAL_GEN, REBALANCING, MEMBER_ID_REQUIRED, FENCED = 0, 25, 22, 27, 79, 82


class Harness:
    def __init__(self, **kw: Any) -> None:
        ids = itertools.count()
        self.c = GroupCoordinator(new_member_id=lambda cid: f"{cid}-{next(ids)}", **kw)
        self.now = 0.0
        self.replies: dict[str, Any] = {}

    def deliver(self, deliveries: list) -> None:
        for token, result in deliveries:
            assert token not in self.replies, f"{token} answered twice"
            self.replies[token] = result

    def join(self, token: str, member_id: str = "", *, protocols=(("range", b"m"),), **kw: Any):
        args = dict(group_id="g", member_id=member_id, instance_id=None, client_id=token,
                    client_host="h", session_timeout=10_000, rebalance_timeout=30_000,
                    protocol_type="consumer", protocols=protocols, require_known_member=False)  # fmt: skip
        args.update(kw)
        self.deliver(self.c.join(self.now, token, **args))
        return self.replies.get(token)

    def sync(self, token: str, member_id: str, generation: int, assignments=()):
        self.deliver(self.c.sync(self.now, token, group_id="g", generation_id=generation,
                                 member_id=member_id, instance_id=None, protocol_type=None,
                                 protocol_name=None, assignments=assignments))  # fmt: skip
        return self.replies.get(token)

    def hb(self, member_id: str, generation: int) -> int:
        return self.c.heartbeat(self.now, group_id="g", generation_id=generation,
                                member_id=member_id, instance_id=None)  # fmt: skip

    def tick(self, ms: float) -> None:
        self.now += ms
        self.deliver(self.c.poll(self.now))

    @property
    def state(self) -> GroupState:
        return self.c.groups["g"].state


def test_single_member_joins_syncs_and_is_stable() -> None:
    h = Harness()
    j = h.join("a")
    assert isinstance(j, JoinResult) and j.error == NONE and j.generation_id == 1
    assert j.leader == j.member_id and [m[0] for m in j.members] == [j.member_id]
    assert h.state is GroupState.COMPLETING_REBALANCE
    s = h.sync("sa", j.member_id, 1, [(j.member_id, b"assign-a")])
    assert s == SyncResult(NONE, "consumer", "range", b"assign-a")
    assert h.state is GroupState.STABLE
    assert h.hb(j.member_id, 1) == NONE
    assert h.hb(j.member_id, 0) == ILLEGAL_GEN
    assert h.hb("nobody", 1) == UNKNOWN_MEMBER


def test_second_member_triggers_rebalance_and_both_get_new_generation() -> None:
    h = Harness()
    a = h.join("a")
    h.sync("sa", a.member_id, 1, [(a.member_id, b"all")])
    assert h.join("b") is None  # waits for the existing member to rejoin
    assert h.state is GroupState.PREPARING_REBALANCE
    assert h.hb(a.member_id, 1) == REBALANCING
    a2 = h.join("a2", a.member_id)
    b = h.replies["b"]
    assert a2.generation_id == b.generation_id == 2
    assert a2.leader == a.member_id and len(a2.members) == 2 and b.members == ()
    assert h.sync("sb", b.member_id, 2) is None  # follower waits for the leader
    h.sync("sa2", a.member_id, 2, [(a.member_id, b"p0"), (b.member_id, b"p1")])
    assert h.replies["sb"].assignment == b"p1" and h.replies["sa2"].assignment == b"p0"
    assert h.state is GroupState.STABLE


def test_member_that_does_not_rejoin_is_dropped_at_rebalance_timeout() -> None:
    h = Harness()
    a = h.join("a")
    h.sync("sa", a.member_id, 1, [(a.member_id, b"x")])
    h.join("b")
    for _ in range(29):  # a keeps heartbeating (and is told to rejoin) but never rejoins
        h.tick(1000)
        assert h.hb(a.member_id, 1) == REBALANCING
    h.tick(999)
    assert "b" not in h.replies
    h.tick(2)
    b = h.replies["b"]
    assert b.error == NONE and b.generation_id == 2 and b.leader == b.member_id
    assert list(h.c.groups["g"].members) == [b.member_id]
    assert h.hb(a.member_id, 2) == UNKNOWN_MEMBER


def test_session_timeout_expires_silent_member_and_rebalances() -> None:
    h = Harness()
    a = h.join("a")
    h.sync("sa", a.member_id, 1, [(a.member_id, b"")])
    b = h.join("b")
    a2 = h.join("a2", a.member_id)
    b = h.replies["b"]
    h.sync("sa2", a.member_id, 2, [])
    h.sync("sb", b.member_id, 2)
    for _ in range(5):
        h.tick(3000)
        assert h.hb(a.member_id, 2) in (NONE, REBALANCING)
    assert h.state is GroupState.PREPARING_REBALANCE  # b went silent for 10 s
    a3 = h.join("a3", a.member_id)
    assert a3.generation_id == 3 and [m[0] for m in a3.members] == [a2.member_id]
    assert h.c.next_deadline() is not None


def test_leave_completes_rebalance_and_last_leave_empties_group() -> None:
    h = Harness()
    a = h.join("a")
    h.sync("sa", a.member_id, 1, [])
    h.join("b")
    top, errs, out = h.c.leave(h.now, group_id="g", members=[(a.member_id, None)])
    h.deliver(out)
    assert (top, errs) == (NONE, [NONE])
    b = h.replies["b"]
    assert b.generation_id == 2 and b.leader == b.member_id
    h.deliver(h.c.leave(h.now, group_id="g", members=[(b.member_id, None)])[2])
    assert h.state is GroupState.EMPTY and h.c.groups["g"].generation == 3
    assert h.c.leave(h.now, group_id="g", members=[("zz", None)])[0] == UNKNOWN_MEMBER


def test_member_id_required_round_trip() -> None:
    h = Harness()
    r = h.join("a", require_known_member=True)
    assert r.error == MEMBER_ID_REQUIRED and r.member_id
    j = h.join("a2", r.member_id, require_known_member=True)
    assert j.error == NONE and j.member_id == r.member_id
    assert h.join("zz", "never-issued").error == UNKNOWN_MEMBER


def test_sync_rules_and_rebalance_cancels_pending_sync() -> None:
    h = Harness()
    a = h.join("a")
    assert h.sync("bad", a.member_id, 5).error == ILLEGAL_GEN
    h.join("b")  # rebalance before the leader synced
    assert h.sync("s-during", a.member_id, 1).error == REBALANCING
    a2 = h.join("a2", a.member_id)
    b = h.replies["b"]
    assert h.sync("sb", b.member_id, 2) is None
    h.join("c")  # a third member arrives while b waits for its assignment
    assert h.replies["sb"].error == REBALANCING
    assert a2.generation_id == 2


def test_unchanged_follower_rejoin_in_stable_returns_current_generation() -> None:
    h = Harness()
    a = h.join("a")
    h.join("b")
    h.join("a2", a.member_id)
    b = h.replies["b"]
    h.sync("sa", a.member_id, 2, [])
    h.sync("sb", b.member_id, 2)
    again = h.join("b2", b.member_id)
    assert again.generation_id == 2 and h.state is GroupState.STABLE
    h.join("b3", b.member_id, protocols=(("roundrobin", b""), ("range", b"m")))
    assert h.state is GroupState.PREPARING_REBALANCE


def test_inconsistent_protocol_and_bad_session_timeout() -> None:
    h = Harness()
    h.join("a")
    assert h.join("b", protocols=(("other", b""),)).error == 23
    assert h.join("c", protocol_type="connect").error == 23
    assert h.join("d", session_timeout=10).error == 26


def test_initial_rebalance_delay_lets_several_members_join_one_generation() -> None:
    h = Harness(initial_rebalance_delay_ms=3000)
    assert h.join("a") is None
    h.tick(1000)
    h.join("b")
    assert not h.replies
    h.tick(2001)
    assert h.replies["a"].generation_id == h.replies["b"].generation_id == 1


def test_static_member_restart_fences_old_id() -> None:
    h = Harness()
    a = h.join("a", instance_id="i1")
    h.sync("sa", a.member_id, 1, [])
    a2 = h.join("a2", instance_id="i1")
    assert a2.error == NONE and a2.member_id != a.member_id and a2.generation_id == 2
    assert h.hb(a.member_id, 2) == UNKNOWN_MEMBER
    assert h.join("a3", a.member_id, instance_id="i1").error == FENCED


def test_simple_commit_rules() -> None:
    h = Harness()
    assert h.c.validate_commit(0, "solo", -1, "", None) == NONE
    a = h.join("a")
    assert h.c.validate_commit(0, "g", -1, "", None) == UNKNOWN_MEMBER
    assert h.c.validate_commit(0, "g", 1, a.member_id, None) == REBALANCING
    h.sync("sa", a.member_id, 1, [])
    assert h.c.validate_commit(0, "g", 1, a.member_id, None) == NONE
    assert h.c.validate_commit(0, "g", 0, a.member_id, None) == ILLEGAL_GEN


@pytest.mark.parametrize("seed", range(30))
def test_random_operations_keep_invariants(seed: int) -> None:
    import random

    rng = random.Random(seed)
    h = Harness()
    known: list[str] = []
    for step in range(200):
        op = rng.choice(["join", "rejoin", "sync", "hb", "leave", "tick"])
        tok = f"t{step}"
        g = h.c.groups.get("g")
        gen = g.generation if g else 0
        if op == "join":
            r = h.join(tok)
            if r is not None and r.member_id:
                known.append(r.member_id)
        elif op == "rejoin" and known:
            h.join(tok, rng.choice(known))
        elif op == "sync" and known:
            mid = rng.choice(known)
            h.sync(tok, mid, gen, [(m, b"x") for m in known])
        elif op == "hb" and known:
            h.hb(rng.choice(known), gen)
        elif op == "leave" and known:
            h.deliver(h.c.leave(h.now, group_id="g", members=[(rng.choice(known), None)])[2])
        else:
            h.tick(rng.choice([100, 5000, 40_000]))
        for r in list(h.replies.values()):
            if isinstance(r, JoinResult):
                known.append(r.member_id)
        known = list(dict.fromkeys(m for m in known if m))
        g = h.c.groups.get("g")
        if g is not None:
            assert (g.state is GroupState.EMPTY) == (
                not g.members
            ) or g.state is GroupState.PREPARING_REBALANCE
            if g.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE):
                assert g.leader in g.members
