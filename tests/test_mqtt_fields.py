"""The MQTT fields (qos, origin, props) are declared once, and the classes keep their layout."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from aaabus.model.ids import AgentId
from aaabus.model.pubsub import MessageProps, MqttFields, Publication, Publish
from aaabus.topics.messages import Carried

# The fields each class had when they were declared in each (names and defaults: what stored
# copies, which pickle their __dict__, and wired ones, encoded as maps by name, go by).
BEFORE = {
    Publish: {"topic", "payload", "retain", "qos", "origin", "props"},
    Publication: {"topic", "payload", "publisher", "filters", "retained", "qos", "origin"}
    | {"props", "retain"},
    Carried: {"topic", "payload", "publisher", "retain", "qos", "origin", "props"},
}


@pytest.mark.parametrize("cls", list(BEFORE), ids=lambda cls: cls.__name__)
def test_each_class_has_the_fields_it_had_and_takes_the_mqtt_ones_from_one_place(
    cls: type,
) -> None:
    assert issubclass(cls, MqttFields)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert set(fields) == BEFORE[cls]
    assert (fields["qos"].default, fields["origin"].default, fields["props"].default) == (
        2,
        "",
        None,
    )


def test_a_copy_pickled_with_the_state_of_before_reads_the_same() -> None:
    props = MessageProps(content_type="text/plain")
    note = Publication(
        "a/b", b"x", AgentId(1, 2, 3), ("a/#",), False, qos=1, origin="d", props=props
    )
    # A copy stored by the release that declared the fields in Publication itself: its state
    # is the same dict of the same names (the order of the keys is not part of a pickle's use).
    state = {
        "topic": "a/b",
        "payload": b"x",
        "publisher": AgentId(1, 2, 3),
        "filters": ("a/#",),
        "retained": False,
        "qos": 1,
        "origin": "d",
        "props": props,
        "retain": False,
    }
    assert vars(note) == state
    old = object.__new__(Publication)
    old.__dict__.update(state)
    assert pickle.loads(pickle.dumps(old)) == note
