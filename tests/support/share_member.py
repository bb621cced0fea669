"""A member of an MQTT shared subscription in a process of its own (tests/test_mqtt_shared.py).

    python tests/support/share_member.py PORT CLIENT_ID FILTER [--receive-max N] [--block-after N]

A paho-mqtt client in MQTT 5.0 mode, clean start, subscribed to FILTER at QoS 2. It prints
``ready`` once its SUBACK is in, then one line per message received, ``TOPIC PAYLOAD``, line
buffered (the test reads them through a pipe). paho delivers a QoS 2 message on PUBREL, once the
server has committed its PUBREC.

``--block-after N``: after printing its N-th message, ``on_message`` blocks for ever, so paho's
loop reads nothing more and sends no PUBCOMP for it; the test then SIGKILLs the process. With
``--receive-max 1`` (5.0's Receive Maximum) the server has sent it nothing beyond that message:
the point of the kill is fixed by the protocol, not by timing.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("client_id")
    parser.add_argument("filter")
    parser.add_argument("--receive-max", type=int, default=None)
    parser.add_argument("--block-after", type=int, default=0)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    client = paho.Client(
        CallbackAPIVersion.VERSION2, client_id=args.client_id, protocol=MQTTProtocolVersion.MQTTv5
    )
    received = 0

    def connected(c: Any, _u: Any, _flags: Any, rc: Any, _p: Any) -> None:
        if rc.value != 0:
            print(f"refused {rc.value}")
            sys.exit(1)
        c.subscribe(args.filter, 2)

    def subscribed(_c: Any, _u: Any, _mid: Any, codes: Any, _p: Any) -> None:
        print("ready" if all(code.value == 2 for code in codes) else f"suback {codes}")

    def message(_c: Any, _u: Any, m: Any) -> None:
        nonlocal received
        print(f"{m.topic} {m.payload.decode()}")
        received += 1
        if received == args.block_after:
            threading.Event().wait()  # paho's loop stops here; the test kills the process

    client.on_connect = connected
    client.on_subscribe = subscribed
    client.on_message = message
    props = Properties(PacketTypes.CONNECT)
    if args.receive_max is not None:
        props.ReceiveMaximum = args.receive_max
    client.connect("127.0.0.1", args.port, keepalive=60, clean_start=True, properties=props)
    client.loop_forever()


if __name__ == "__main__":
    main()
