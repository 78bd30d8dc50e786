"""Group APIs: FindCoordinator, Join/Sync/Heartbeat/LeaveGroup, OffsetCommit/Fetch, Describe/List.

This node coordinates every group. The rebalance logic is `groups.GroupCoordinator`; here requests
become coordinator calls with a future as the reply token, and committed offsets go through
`offsets.OffsetStore` (answered after fsync).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kio.schema.errors import ErrorCode as E

from .groups import GroupState, JoinResult, SyncResult
from .offsets import CommittedOffset
from .protocol import Request, build, response_module

if TYPE_CHECKING:
    from .broker import Broker, ConnInfo

GROUP_KEY, TXN_KEY = 0, 1
MAX_METADATA = 4096  # [offset.metadata.max.bytes]
INT32_MIN = -(2**31)


def _ms(td: Any) -> int:
    return int(td.total_seconds() * 1000)


async def find_coordinator(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(10, v)
    key_type = getattr(body, "key_type", GROUP_KEY)
    node, host = b.config.node_id, b.config.advertised_host or conn.local_host
    port = conn.local_port or b.port  # the listener the client came in on (plaintext or TLS)

    def answer(key: str) -> dict[str, Any]:
        if key_type in (GROUP_KEY, TXN_KEY):  # this node coordinates groups and transactions
            return dict(key=key, node_id=node, host=host, port=port, error_code=E.none,
                        error_message=None)  # fmt: skip
        return dict(key=key, node_id=-1, host="", port=-1, error_code=E.invalid_request,
                    error_message=f"unknown key type {key_type}")  # fmt: skip

    if v >= 4:
        coords = tuple(build(mod.Coordinator, **answer(k)) for k in body.coordinator_keys)
        return build(mod.FindCoordinatorResponse, throttle_time=0, coordinators=coords)
    return build(mod.FindCoordinatorResponse, throttle_time=0, **answer(body.key))


async def join_group(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(11, v)
    fut: asyncio.Future[JoinResult] = asyncio.get_running_loop().create_future()
    session = _ms(body.session_timeout)
    b.deliver(
        b.groups.join(
            b.now_ms(), fut, group_id=body.group_id, member_id=body.member_id,
            instance_id=getattr(body, "group_instance_id", None),
            client_id=req.client_id or "", client_host=f"/{conn.peer_host}",
            session_timeout=session,
            rebalance_timeout=_ms(body.rebalance_timeout) if v >= 1 else session,
            protocol_type=body.protocol_type,
            protocols=[(p.name, p.metadata) for p in body.protocols],
            require_known_member=v >= 4,
        )
    )  # fmt: skip
    r = await fut
    members = tuple(
        build(mod.JoinGroupResponseMember, member_id=mid, group_instance_id=iid, metadata=meta)
        for mid, iid, meta in r.members
    )
    return build(mod.JoinGroupResponse, throttle_time=0, error_code=r.error,
                 generation_id=r.generation_id, protocol_type=r.protocol_type,
                 protocol_name=r.protocol_name if v >= 7 else (r.protocol_name or ""),
                 leader=r.leader, member_id=r.member_id, members=members)  # fmt: skip


async def sync_group(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body = req.body
    mod = response_module(14, req.api_version)
    fut: asyncio.Future[SyncResult] = asyncio.get_running_loop().create_future()
    b.deliver(
        b.groups.sync(
            b.now_ms(), fut, group_id=body.group_id, generation_id=body.generation_id,
            member_id=body.member_id, instance_id=getattr(body, "group_instance_id", None),
            protocol_type=getattr(body, "protocol_type", None),
            protocol_name=getattr(body, "protocol_name", None),
            assignments=[(a.member_id, a.assignment) for a in body.assignments],
        )
    )  # fmt: skip
    r = await fut
    return build(mod.SyncGroupResponse, throttle_time=0, error_code=r.error,
                 protocol_type=r.protocol_type, protocol_name=r.protocol_name,
                 assignment=r.assignment)  # fmt: skip


async def heartbeat(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body = req.body
    error = b.groups.heartbeat(
        b.now_ms(), group_id=body.group_id, generation_id=body.generation_id,
        member_id=body.member_id, instance_id=getattr(body, "group_instance_id", None),
    )  # fmt: skip
    b.deliver([])
    return build(response_module(12, req.api_version).HeartbeatResponse, throttle_time=0,
                 error_code=error)  # fmt: skip


async def leave_group(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(13, v)
    if v < 3:
        members = [(body.member_id, None)]
    else:
        members = [(m.member_id, m.group_instance_id) for m in body.members]
    top, errors, deliveries = b.groups.leave(b.now_ms(), group_id=body.group_id, members=members)
    b.deliver(deliveries)
    if v < 3:
        return build(mod.LeaveGroupResponse, throttle_time=0, error_code=top)
    responses = tuple(
        build(mod.MemberResponse, member_id=mid, group_instance_id=iid, error_code=err)
        for (mid, iid), err in zip(members, errors, strict=True)
    )
    group_error = E.unknown_member_id if b.groups.group(body.group_id) is None else E.none
    return build(mod.LeaveGroupResponse, throttle_time=0, error_code=group_error,
                 members=responses)  # fmt: skip


async def offset_commit(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body = req.body
    mod = response_module(8, req.api_version)
    group_error = b.groups.validate_commit(
        b.now_ms(), body.group_id, body.generation_id_or_member_epoch, body.member_id,
        getattr(body, "group_instance_id", None),
    )  # fmt: skip
    if not body.group_id:
        group_error = E.invalid_group_id
    known = b.store.topics()
    items: list[tuple[str, int, CommittedOffset]] = []
    topics = []
    for t in body.topics:
        count = known.get(t.name)
        allowed = b.authorized(conn, req.client_id, t.name, "read")  # Kafka: Read on the topic
        parts = []
        for p in t.partitions:
            err = group_error
            if not err and not allowed:
                err = E.topic_authorization_failed
            elif not err and (count is None or not 0 <= p.partition_index < count):
                err = E.unknown_topic_or_partition
            elif not err and p.committed_metadata and len(p.committed_metadata) > MAX_METADATA:
                err = E.offset_metadata_too_large
            elif not err:
                epoch = getattr(p, "committed_leader_epoch", -1)
                committed = CommittedOffset(p.committed_offset, epoch, p.committed_metadata)
                items.append((t.name, p.partition_index, committed))
            parts.append(
                build(
                    mod.OffsetCommitResponsePartition,
                    partition_index=p.partition_index,
                    error_code=err,
                )  # fmt: skip
            )
        topics.append(build(mod.OffsetCommitResponseTopic, name=t.name, partitions=tuple(parts)))
    await b.offsets.commit(body.group_id, items)
    return build(mod.OffsetCommitResponse, throttle_time=0, topics=tuple(topics))


def _fetch_group(
    b: Broker,
    mod: Any,
    group: str,
    topics: Any,
    v: int,
    may: Callable[[str, bool], bool],
    stable: bool = False,
) -> tuple[Any, ...] | None:
    """Committed offsets; topics it may not describe are left out of an all-topics answer and
    TOPIC_AUTHORIZATION_FAILED when named, as Kafka does; with `stable` (v7+ require_stable) a
    partition an open transaction will change is UNSTABLE_OFFSET_COMMIT (KIP-447)."""
    names = mod.OffsetFetchResponseTopics if v >= 8 else mod.OffsetFetchResponseTopic
    parts_cls = mod.OffsetFetchResponsePartitions if v >= 8 else mod.OffsetFetchResponsePartition
    if topics is None:  # all committed partitions of the group (v2+)
        wanted: dict[str, list[int]] = {}
        for t, p in sorted(b.offsets.partitions(group)):
            if may(t, False):
                wanted.setdefault(t, []).append(p)
    else:
        wanted = {t.name: list(t.partition_indexes) for t in topics}
    out = []
    for name, partitions in wanted.items():
        parts = []
        allowed = topics is None or may(name, True)
        for p in partitions:
            c = b.offsets.get(group, name, p) if allowed else None
            parts.append(
                build(
                    parts_cls,
                    partition_index=p,
                    committed_offset=c.offset if c else -1,
                    committed_leader_epoch=c.leader_epoch if c else -1,
                    metadata=(c.metadata if c else "") or "",
                    error_code=E.topic_authorization_failed
                    if not allowed
                    else E.unstable_offset_commit
                    if stable and b.txns.pending_offset(group, (name, p))
                    else E.none,
                )  # fmt: skip
            )
        out.append(build(names, name=name, partitions=tuple(parts)))
    return tuple(out)


async def offset_fetch(b: Broker, req: Request, conn: ConnInfo) -> Any:
    body, v = req.body, req.api_version
    mod = response_module(9, v)

    def may(topic: str, count: bool) -> bool:
        return b.authorized(conn, req.client_id, topic, "describe", count)

    if v >= 8:
        groups = tuple(
            build(
                mod.OffsetFetchResponseGroup,
                group_id=g.group_id,
                error_code=E.none,
                topics=_fetch_group(b, mod, g.group_id, g.topics, v, may, body.require_stable),
            )  # fmt: skip
            for g in body.groups
        )
        return build(mod.OffsetFetchResponse, throttle_time=0, groups=groups)
    stable = getattr(body, "require_stable", False)
    topics = _fetch_group(b, mod, body.group_id, body.topics, v, may, stable)
    return build(mod.OffsetFetchResponse, throttle_time=0, topics=topics, error_code=E.none)


async def describe_groups(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(15, req.api_version)
    want_ops = getattr(req.body, "include_authorized_operations", False)
    out = []
    for group_id in req.body.groups:
        g = b.groups.group(group_id)
        if g is None:
            out.append(
                build(
                    mod.DescribedGroup,
                    error_code=E.none,
                    group_id=group_id,
                    group_state=GroupState.DEAD.value,
                    protocol_type="",
                    protocol_data="",
                    members=(),
                    authorized_operations=INT32_MIN,
                )  # fmt: skip
            )
            continue
        stable = g.state is GroupState.STABLE
        members = tuple(
            build(
                mod.DescribedGroupMember,
                member_id=m.member_id,
                group_instance_id=m.instance_id,
                client_id=m.client_id,
                client_host=m.client_host,
                member_metadata=m.metadata(g.protocol or "") if stable else b"",
                member_assignment=m.assignment if stable else b"",
            )  # fmt: skip
            for m in g.members.values()
        )
        out.append(
            build(mod.DescribedGroup, error_code=E.none, group_id=group_id,
                  group_state=g.state.value, protocol_type=g.protocol_type or "",
                  protocol_data=(g.protocol or "") if stable else "", members=members,
                  authorized_operations=(1 << 3) | (1 << 6) | (1 << 8) if want_ops else INT32_MIN)
        )  # fmt: skip
    return build(mod.DescribeGroupsResponse, throttle_time=0, groups=tuple(out))


async def list_groups(b: Broker, req: Request, conn: ConnInfo) -> Any:
    mod = response_module(16, req.api_version)
    states = {s.lower() for s in getattr(req.body, "states_filter", ()) or ()}
    listed = []
    for group_id, g in sorted(b.groups.groups.items()):
        if states and g.state.value.lower() not in states:
            continue
        listed.append(
            build(
                mod.ListedGroup,
                group_id=group_id,
                protocol_type=g.protocol_type or "",
                group_state=g.state.value,
            )  # fmt: skip
        )
    return build(mod.ListGroupsResponse, throttle_time=0, error_code=E.none, groups=tuple(listed))
