"""Sans-IO MQTT 3.1 / 3.1.1 / 5.0 protocol core: bytes in, events out; events in, bytes out.

No asyncio, no sockets: the asyncio server (`mqtt_proxy/server.py`) owns the transport and calls
into this package. Modelled on h11.

Receiving::

    parser = Parser(max_packet_size=1 << 20)      # version unknown: first packet must be CONNECT
    for packet in parser.feed(chunk):             # whole chunk parsed, tail kept
        match packet:
            case Connect(): ...                   # parser.version is now 3, 4 or 5
            case Publish(topic=t, payload=p, qos=q, packet_id=pid): ...

Sending::

    data = encode(Connack(reason_code=0), version=parser.version)
    data = encode_publish("a/b", b"x", qos=1, packet_id=7, version=5)

State machine (what a server uses)::

    conn = Connection(SERVER, max_packet_size=1 << 20)
    try:
        for packet in conn.receive_data(chunk):   # state checked, topic aliases resolved,
            ...                                   # receive maximum enforced
        transport.write(conn.send(Connack(properties=make_properties(topic_alias_maximum=16))))
    except RemoteProtocolError as err:
        transport.write(conn.error_bytes(err))    # CONNACK / v5 DISCONNECT / b"" for v3
        transport.close()

Fan-out (encode once, write many; see `encoder` docstring)::

    tpl = PublishTemplate.build(topic, payload, qos=1, version=4)
    transport.write(tpl.packet(pid))              # QoS 0: tpl.data, the same bytes object for all

Errors: `RemoteProtocolError` (peer broke the spec) and `LocalProtocolError` (we misused the API),
each with `reason_code` (MQTT 5 terms). Events are immutable named tuples, validated when
constructed by our code; the parser builds them directly after checking the wire rules.
"""

from .connection import CLIENT, SERVER, Connection, Role, State
from .encoder import (
    PINGREQ,
    PINGRESP,
    PublishTemplate,
    encode,
    encode_publish,
    publish_qos0,
    publish_qos0_alias,
    publish_v3_qos1,
)
from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    TopicSubscription,
    Unsuback,
    Unsubscribe,
    Will,
    chunk_kind,
)
from .parser import DEFAULT_MAX_PACKET_SIZE, PROTOCOL_MAX_PACKET_SIZE, Parser
from .properties import EMPTY_PROPERTIES, Properties, PropertyId, make_properties
from .reason_codes import ConnackReturnCode, ReasonCode, v3_connack_code
from .topics import split_shared, topic_filter_error, topic_name_error

__all__ = [
    "chunk_kind",
    "CLIENT",
    "SERVER",
    "Connection",
    "Role",
    "State",
    "PINGREQ",
    "PINGRESP",
    "PublishTemplate",
    "encode",
    "encode_publish",
    "publish_qos0",
    "publish_qos0_alias",
    "publish_v3_qos1",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Auth",
    "Connack",
    "Connect",
    "Disconnect",
    "Packet",
    "PacketType",
    "Pingreq",
    "Pingresp",
    "Puback",
    "Pubcomp",
    "Publish",
    "Pubrec",
    "Pubrel",
    "Suback",
    "Subscribe",
    "TopicSubscription",
    "Unsuback",
    "Unsubscribe",
    "Will",
    "DEFAULT_MAX_PACKET_SIZE",
    "PROTOCOL_MAX_PACKET_SIZE",
    "Parser",
    "EMPTY_PROPERTIES",
    "Properties",
    "PropertyId",
    "make_properties",
    "ConnackReturnCode",
    "ReasonCode",
    "v3_connack_code",
    "split_shared",
    "topic_filter_error",
    "topic_name_error",
]
