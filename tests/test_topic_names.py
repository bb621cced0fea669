"""Topic names and filters: MQTT matching checked against an independent regex translation."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.errors import AaabusError, TopicError
from aaabus.model.topicnames import check_filter, check_topic, matches


def reference_match(topic_filter: str, topic: str) -> bool:
    """MQTT's rules written another way: the filter as a regular expression."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False
    parts: list[str] = []
    levels = topic_filter.split("/")
    for level in levels:
        if level == "#":
            # "a/#" also matches "a" (the parent level); "#" alone matches everything.
            return re.fullmatch("/".join(parts) + ("(/.*)?" if parts else ".*"), topic) is not None
        parts.append("[^/]*" if level == "+" else re.escape(level))
    return re.fullmatch("/".join(parts), topic) is not None


LEVEL = st.sampled_from(["a", "b", "", "$s", "cc"])
topics = st.lists(LEVEL, min_size=1, max_size=5).map("/".join).filter(bool)


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(
        st.lists(st.sampled_from(["a", "b", "", "+", "cc", "$s"]), min_size=1, max_size=5)
    )
    if draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(topic_filter=filters(), topic=topics)
def test_matching_agrees_with_a_regex_translation_of_the_rules(
    topic_filter: str, topic: str
) -> None:
    check_filter(topic_filter)
    check_topic(topic)
    assert matches(topic_filter, topic) == reference_match(topic_filter, topic)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(topic=topics.filter(lambda t: not t.startswith("$")), data=st.data())
def test_a_filter_made_from_a_topic_by_wildcards_matches_it(
    topic: str, data: st.DataObject
) -> None:
    levels = topic.split("/")
    wild = [data.draw(st.sampled_from([level, "+"])) for level in levels]
    cut = data.draw(st.integers(0, len(levels)))
    topic_filter = "/".join([*wild[:cut], "#"]) if data.draw(st.booleans()) else "/".join(wild)
    assert matches(check_filter(topic_filter), topic)


@pytest.mark.parametrize(
    ("topic_filter", "topic", "expected"),
    [
        ("sport/#", "sport", True),
        ("sport/#", "sport/tennis/player1", True),
        ("sport/tennis/#", "sport/tennis", True),
        ("sport/+", "sport", False),
        ("sport/+", "sport/", True),
        ("+/+", "/finance", True),
        ("/+", "/finance", True),
        ("+", "/finance", False),
        ("#", "$SYS/uptime", False),
        ("$SYS/#", "$SYS/uptime", True),
        ("+/monitor", "$SYS/monitor", False),
        ("a/b", "a/b/c", False),
    ],
)
def test_matching_table_of_the_mqtt_specification(
    topic_filter: str, topic: str, expected: bool
) -> None:
    assert matches(topic_filter, topic) is expected


@pytest.mark.parametrize(
    ("topic_filter", "says"),
    [
        ("sport/#/ranking", "# must be the last level"),
        ("sport#", "a wildcard must be a whole level"),
        ("sport/tennis+", "a wildcard must be a whole level"),
        ("", "empty topic filter"),
        ("a\0b", "NUL"),
    ],
)
def test_bad_filters_are_one_line_topic_errors(topic_filter: str, says: str) -> None:
    with pytest.raises(TopicError) as caught:
        check_filter(topic_filter)
    assert says in str(caught.value) and "\n" not in str(caught.value)
    assert isinstance(caught.value, AaabusError)


@pytest.mark.parametrize("topic", ["a/+", "a/#", "", 7])
def test_topic_names_refuse_wildcards_emptiness_and_non_text(topic: object) -> None:
    with pytest.raises(TopicError):
        check_topic(topic)


def test_topic_names_longer_than_mqtt_allows_are_refused() -> None:
    with pytest.raises(TopicError, match="longer than 65535 bytes"):
        check_topic("é" * 40000)
