"""Classic consumer-group coordinator (JoinGroup/SyncGroup/Heartbeat/LeaveGroup), sans-IO.

Theory of operation
-------------------
Mirrors Kafka's `GroupCoordinator` / `GroupMetadata`. A group moves through:

    Empty --join--> PreparingRebalance --all joined / rebalance timeout--> CompletingRebalance
    CompletingRebalance --leader SyncGroup--> Stable
    Stable | CompletingRebalance --join with new metadata, leave, session expiry--> PreparingRebalance
    PreparingRebalance --every member gone--> Empty        (generation still advances)

JoinGroup and SyncGroup answers are delayed until the rebalance reaches the point that decides them,
so no method here blocks or does IO: each takes the current time in ms and an opaque `reply` token
chosen by the caller and returns `Delivery` pairs (token, result) for every reply that is now
decided — its own or other members'. The caller owns the clock: after each call it asks
`next_deadline()` and calls `poll(now)` at that time, which expires sessions (members silent for
`session_timeout`), ends rebalances whose `rebalance_timeout` passed (members that did not rejoin
are dropped) and drops members that never sent SyncGroup after a join completed.

Groups are not persisted (as in Kafka after a coordinator move, members re-join with
UNKNOWN_MEMBER_ID); committed offsets are, in `offsets.py`. Static members (group.instance.id)
are supported with one simplification: a static member re-joining under a new member id fences the
old id and triggers a normal rebalance instead of Kafka's rebalance-free replacement.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kio.schema.errors import ErrorCode as E

__all__ = [
    "Delivery",
    "GroupCoordinator",
    "GroupState",
    "IllegalStateTransition",
    "JoinResult",
    "SyncResult",
]


class GroupState(enum.Enum):
    EMPTY = "Empty"
    PREPARING_REBALANCE = "PreparingRebalance"
    COMPLETING_REBALANCE = "CompletingRebalance"
    STABLE = "Stable"
    DEAD = "Dead"


_S = GroupState
# state -> states it may move to (Kafka's GroupState.validPreviousStates, inverted).
TRANSITIONS: dict[GroupState, frozenset[GroupState]] = {
    _S.EMPTY: frozenset({_S.PREPARING_REBALANCE, _S.DEAD}),
    _S.PREPARING_REBALANCE: frozenset({_S.COMPLETING_REBALANCE, _S.EMPTY, _S.DEAD}),
    _S.COMPLETING_REBALANCE: frozenset({_S.PREPARING_REBALANCE, _S.STABLE, _S.DEAD}),
    _S.STABLE: frozenset({_S.PREPARING_REBALANCE, _S.DEAD}),
    _S.DEAD: frozenset(),
}


class IllegalStateTransition(RuntimeError):
    """A bug in this module: a transition the table does not allow."""


@dataclass(frozen=True, slots=True)
class JoinResult:
    error: int
    generation_id: int = -1
    protocol_type: str | None = None
    protocol_name: str | None = None
    leader: str = ""
    member_id: str = ""
    members: tuple[tuple[str, str | None, bytes], ...] = ()  # (member id, instance id, metadata)


@dataclass(frozen=True, slots=True)
class SyncResult:
    error: int
    protocol_type: str | None = None
    protocol_name: str | None = None
    assignment: bytes = b""


Delivery = tuple[Any, Any]  # (reply token, JoinResult | SyncResult | int error code)


@dataclass(slots=True)
class Member:
    member_id: str
    instance_id: str | None
    client_id: str
    client_host: str
    session_timeout: int
    rebalance_timeout: int
    protocols: tuple[tuple[str, bytes], ...]
    assignment: bytes = b""
    join_reply: Any = None  # token of a JoinGroup waiting for the rebalance
    sync_reply: Any = None  # token of a SyncGroup waiting for the leader
    synced: bool = False
    deadline: float = 0.0  # session expiry

    def metadata(self, protocol: str) -> bytes:
        for name, meta in self.protocols:
            if name == protocol:
                return meta
        return b""


@dataclass(slots=True)
class Group:
    group_id: str
    state: GroupState = GroupState.EMPTY
    generation: int = 0
    protocol_type: str | None = None
    protocol: str | None = None
    leader: str | None = None
    members: dict[str, Member] = field(default_factory=dict)
    pending: dict[str, float] = field(default_factory=dict)  # MEMBER_ID_REQUIRED ids -> deadline
    instances: dict[str, str] = field(default_factory=dict)  # group.instance.id -> member id
    rebalance_deadline: float = 0.0
    join_not_before: float = 0.0  # initial rebalance delay for groups that were empty
    sync_deadline: float = 0.0

    def transition(self, to: GroupState) -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalStateTransition(
                f"group {self.group_id!r}: {self.state.value} -> {to.value}"
            )
        self.state = to

    def candidates(self) -> set[str]:
        sets = [{name for name, _ in m.protocols} for m in self.members.values()]
        return set.intersection(*sets) if sets else set()

    def supports(self, protocol_type: str, protocols: Sequence[tuple[str, bytes]]) -> bool:
        if not self.members:
            return bool(protocol_type) and bool(protocols)
        names = {name for name, _ in protocols}
        return self.protocol_type == protocol_type and bool(names & self.candidates())

    def select_protocol(self) -> str:
        cands = self.candidates()
        votes: dict[str, int] = {}
        for m in self.members.values():
            choice = next(name for name, _ in m.protocols if name in cands)
            votes[choice] = votes.get(choice, 0) + 1
        return max(votes, key=lambda n: votes[n])


class GroupCoordinator:
    """All classic groups of this broker. Event-loop-only (single-threaded by design)."""

    def __init__(
        self,
        *,
        min_session_timeout_ms: int = 6000,
        max_session_timeout_ms: int = 1_800_000,
        initial_rebalance_delay_ms: int = 0,
        new_member_id: Callable[[str], str] | None = None,
    ) -> None:
        self.min_session_timeout_ms = min_session_timeout_ms
        self.max_session_timeout_ms = max_session_timeout_ms
        self.initial_rebalance_delay_ms = initial_rebalance_delay_ms
        self._new_member_id = new_member_id or (lambda client_id: f"{client_id}-{uuid.uuid4()}")
        self.groups: dict[str, Group] = {}

    # --- queries ------------------------------------------------------------------------

    def group(self, group_id: str) -> Group | None:
        return self.groups.get(group_id)

    def ensure_group(self, group_id: str) -> Group:
        """Groups that only commit offsets (assign() consumers) exist too, as Empty."""
        g = self.groups.get(group_id)
        if g is None:
            g = self.groups[group_id] = Group(group_id)
        return g

    def next_deadline(self) -> float | None:
        times: list[float] = []
        for g in self.groups.values():
            times.extend(g.pending.values())
            for m in g.members.values():
                if m.join_reply is None and m.sync_reply is None:
                    times.append(m.deadline)
            if g.state is GroupState.PREPARING_REBALANCE:
                times.append(g.rebalance_deadline)
                if not g.pending and all(m.join_reply is not None for m in g.members.values()):
                    times.append(g.join_not_before)  # only the initial delay holds it back
            elif g.state is GroupState.COMPLETING_REBALANCE:
                times.append(g.sync_deadline)
        return min(times) if times else None

    # --- JoinGroup ----------------------------------------------------------------------

    def join(
        self,
        now: float,
        reply: Any,
        *,
        group_id: str,
        member_id: str,
        instance_id: str | None,
        client_id: str,
        client_host: str,
        session_timeout: int,
        rebalance_timeout: int,
        protocol_type: str,
        protocols: Sequence[tuple[str, bytes]],
        require_known_member: bool,
    ) -> list[Delivery]:
        if not group_id:
            return [(reply, JoinResult(E.invalid_group_id, member_id=member_id))]
        if not self.min_session_timeout_ms <= session_timeout <= self.max_session_timeout_ms:
            return [(reply, JoinResult(E.invalid_session_timeout, member_id=member_id))]
        g = self.ensure_group(group_id)
        protocols = tuple(protocols)
        if not g.supports(protocol_type, protocols):
            return [(reply, JoinResult(E.inconsistent_group_protocol, member_id=member_id))]
        out: list[Delivery] = []
        if instance_id is not None and instance_id in g.instances:
            old = g.instances[instance_id]
            if member_id and member_id != old:
                return [(reply, JoinResult(E.fenced_instance_id, member_id=member_id))]
            if not member_id:  # a restarted static member takes over its old identity
                self._remove(g, old, E.fenced_instance_id, out)
        if not member_id:
            member_id = self._new_member_id(client_id)
            if require_known_member and instance_id is None:
                g.pending[member_id] = now + session_timeout
                return [(reply, JoinResult(E.member_id_required, member_id=member_id))]
        elif member_id not in g.members and member_id not in g.pending:
            return [(reply, JoinResult(E.unknown_member_id, member_id=member_id))]
        m = g.members.get(member_id)
        if m is None:
            g.pending.pop(member_id, None)
            m = Member(member_id, instance_id, client_id, client_host, session_timeout,
                       rebalance_timeout, protocols)  # fmt: skip
            g.members[member_id] = m
            if instance_id is not None:
                g.instances[instance_id] = member_id
            if g.protocol_type is None or len(g.members) == 1:
                g.protocol_type = protocol_type
            m.join_reply = reply
            self._prepare_rebalance(g, now, out)
        else:
            changed = m.protocols != protocols
            m.protocols, m.session_timeout = protocols, session_timeout
            m.rebalance_timeout = rebalance_timeout
            m.deadline = now + session_timeout
            if g.state is GroupState.PREPARING_REBALANCE:
                if m.join_reply is not None:
                    out.append(
                        (m.join_reply, JoinResult(E.rebalance_in_progress, member_id=member_id))
                    )
                m.join_reply = reply
            elif not changed and (
                g.state is GroupState.COMPLETING_REBALANCE
                or (g.state is GroupState.STABLE and g.leader != member_id)
            ):
                out.append((reply, self._join_result(g, m)))
                return out
            else:
                m.join_reply = reply
                self._prepare_rebalance(g, now, out)
        self._maybe_complete_join(g, now, out)
        return out

    # --- SyncGroup ----------------------------------------------------------------------

    def sync(
        self,
        now: float,
        reply: Any,
        *,
        group_id: str,
        generation_id: int,
        member_id: str,
        instance_id: str | None,
        protocol_type: str | None,
        protocol_name: str | None,
        assignments: Sequence[tuple[str, bytes]],
    ) -> list[Delivery]:
        g = self.groups.get(group_id)
        err = self._check_member(g, member_id, instance_id, generation_id)
        if err:
            return [(reply, SyncResult(err))]
        assert g is not None
        if (protocol_type is not None and protocol_type != g.protocol_type) or (
            protocol_name is not None and protocol_name != g.protocol
        ):
            return [(reply, SyncResult(E.inconsistent_group_protocol))]
        m = g.members[member_id]
        m.deadline = now + m.session_timeout
        if g.state is GroupState.PREPARING_REBALANCE:
            return [(reply, SyncResult(E.rebalance_in_progress))]
        if g.state is GroupState.STABLE:
            m.synced = True
            return [(reply, self._sync_result(g, m))]
        out: list[Delivery] = []
        if m.sync_reply is not None:
            out.append((m.sync_reply, SyncResult(E.rebalance_in_progress)))
        m.sync_reply, m.synced = reply, True
        if member_id == g.leader:
            given = dict(assignments)
            for mid, member in g.members.items():
                member.assignment = given.get(mid, b"")
            g.transition(GroupState.STABLE)
            for member in g.members.values():
                if member.sync_reply is not None:
                    out.append((member.sync_reply, self._sync_result(g, member)))
                    member.sync_reply = None
                    member.deadline = now + member.session_timeout
        return out

    # --- Heartbeat / LeaveGroup / OffsetCommit validation ---------------------------------

    def heartbeat(
        self, now: float, *, group_id: str, generation_id: int, member_id: str,
        instance_id: str | None,
    ) -> int:  # fmt: skip
        g = self.groups.get(group_id)
        err = self._check_member(g, member_id, instance_id, generation_id)
        if err:
            return err
        assert g is not None
        m = g.members[member_id]
        m.deadline = now + m.session_timeout
        if g.state is GroupState.PREPARING_REBALANCE:
            return E.rebalance_in_progress
        return E.none

    def leave(
        self, now: float, *, group_id: str, members: Sequence[tuple[str, str | None]]
    ) -> tuple[int, list[int], list[Delivery]]:
        """Remove members; returns (top-level error, per-member errors, deliveries)."""
        g = self.groups.get(group_id)
        out: list[Delivery] = []
        if g is None:
            return E.unknown_member_id, [E.unknown_member_id] * len(members), out
        errors: list[int] = []
        removed = False
        for member_id, instance_id in members:
            if instance_id is not None:
                owner = g.instances.get(instance_id)
                if owner is None:
                    errors.append(E.unknown_member_id)
                    continue
                if member_id and member_id != owner:
                    errors.append(E.fenced_instance_id)
                    continue
                member_id = owner
            if member_id in g.pending:
                del g.pending[member_id]
                errors.append(E.none)
                continue
            if member_id not in g.members:
                errors.append(E.unknown_member_id)
                continue
            self._remove(g, member_id, E.unknown_member_id, out)
            errors.append(E.none)
            removed = True
        if removed:
            self._after_removal(g, now, out)
        top = errors[0] if len(members) == 1 else E.none
        return top, errors, out

    def validate_commit(
        self, now: float, group_id: str, generation_id: int, member_id: str,
        instance_id: str | None,
    ) -> int:  # fmt: skip
        """OffsetCommit rules: generation -1 is a "simple" commit, allowed only for empty groups."""
        g = self.groups.get(group_id)
        if generation_id < 0 and (g is None or not g.members):
            self.ensure_group(group_id)
            return E.none
        err = self._check_member(g, member_id, instance_id, generation_id)
        if err:
            return err
        assert g is not None
        if g.state is GroupState.COMPLETING_REBALANCE:
            return E.rebalance_in_progress
        m = g.members[member_id]
        m.deadline = now + m.session_timeout
        return E.none

    # --- timers ---------------------------------------------------------------------------

    def poll(self, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        for g in list(self.groups.values()):
            for mid, deadline in list(g.pending.items()):
                if deadline <= now:
                    del g.pending[mid]
            expired = [
                mid
                for mid, m in g.members.items()
                if m.join_reply is None and m.sync_reply is None and m.deadline <= now
            ]
            if g.state is GroupState.PREPARING_REBALANCE and g.rebalance_deadline <= now:
                expired += [mid for mid, m in g.members.items() if m.join_reply is None]
                g.pending.clear()
            elif g.state is GroupState.COMPLETING_REBALANCE and g.sync_deadline <= now:
                expired += [mid for mid, m in g.members.items() if not m.synced]
            for mid in dict.fromkeys(expired):
                self._remove(g, mid, E.unknown_member_id, out)
            if expired:
                self._after_removal(g, now, out)
            elif g.state is GroupState.PREPARING_REBALANCE:
                self._maybe_complete_join(g, now, out)
        return out

    # --- internals ------------------------------------------------------------------------

    def _check_member(
        self, g: Group | None, member_id: str, instance_id: str | None, generation_id: int
    ) -> int:
        if g is None or g.state is GroupState.DEAD:
            return E.unknown_member_id
        if instance_id is not None and g.instances.get(instance_id, member_id) != member_id:
            return E.fenced_instance_id
        if member_id not in g.members:
            return E.unknown_member_id
        if generation_id != g.generation:
            return E.illegal_generation
        return E.none

    def _prepare_rebalance(self, g: Group, now: float, out: list[Delivery]) -> None:
        if g.state is GroupState.PREPARING_REBALANCE:
            g.rebalance_deadline = max(g.rebalance_deadline, now + self._rebalance_timeout(g))
            return
        if g.state is GroupState.COMPLETING_REBALANCE:
            for m in g.members.values():
                if m.sync_reply is not None:
                    out.append((m.sync_reply, SyncResult(E.rebalance_in_progress)))
                    m.sync_reply = None
        was_empty = g.state is GroupState.EMPTY
        g.transition(GroupState.PREPARING_REBALANCE)
        g.rebalance_deadline = now + self._rebalance_timeout(g)
        g.join_not_before = now + self.initial_rebalance_delay_ms if was_empty else now

    def _rebalance_timeout(self, g: Group) -> int:
        return max((m.rebalance_timeout for m in g.members.values()), default=0)

    def _maybe_complete_join(self, g: Group, now: float, out: list[Delivery]) -> None:
        if g.state is not GroupState.PREPARING_REBALANCE:
            return
        all_joined = not g.pending and all(m.join_reply is not None for m in g.members.values())
        if not (all_joined and now >= g.join_not_before) and now < g.rebalance_deadline:
            return
        g.generation += 1
        if not g.members:  # like Kafka, an empty group keeps its protocol type
            g.protocol = g.leader = None
            g.transition(GroupState.EMPTY)
            return
        g.protocol = g.select_protocol()
        if g.leader not in g.members:
            g.leader = next(iter(g.members))
        g.transition(GroupState.COMPLETING_REBALANCE)
        g.sync_deadline = now + self._rebalance_timeout(g)
        for m in g.members.values():
            m.assignment, m.synced = b"", False
            out.append((m.join_reply, self._join_result(g, m)))
            m.join_reply = None
            m.deadline = now + m.session_timeout

    def _join_result(self, g: Group, m: Member) -> JoinResult:
        members: tuple[tuple[str, str | None, bytes], ...] = ()
        if m.member_id == g.leader:
            assert g.protocol is not None
            members = tuple(
                (x.member_id, x.instance_id, x.metadata(g.protocol)) for x in g.members.values()
            )
        return JoinResult(E.none, g.generation, g.protocol_type, g.protocol, g.leader or "",
                          m.member_id, members)  # fmt: skip

    def _sync_result(self, g: Group, m: Member) -> SyncResult:
        return SyncResult(E.none, g.protocol_type, g.protocol, m.assignment)

    def _remove(self, g: Group, member_id: str, error: int, out: list[Delivery]) -> None:
        m = g.members.pop(member_id, None)
        if m is None:
            return
        if m.instance_id is not None and g.instances.get(m.instance_id) == member_id:
            del g.instances[m.instance_id]
        if m.join_reply is not None:
            out.append((m.join_reply, JoinResult(error, member_id=member_id)))
        if m.sync_reply is not None:
            out.append((m.sync_reply, SyncResult(error)))
        if g.leader == member_id:
            g.leader = next(iter(g.members), None)

    def _after_removal(self, g: Group, now: float, out: list[Delivery]) -> None:
        if g.state in (GroupState.STABLE, GroupState.COMPLETING_REBALANCE):
            self._prepare_rebalance(g, now, out)
        if g.state is GroupState.PREPARING_REBALANCE:
            self._maybe_complete_join(g, now, out)
