"""A voter's answers to a candidate (aaabus.node.voter) without a network: the requests it
refuses in one line, and the vote it refuses while it has been running for less than the
failover delay (it could not have heard the server yet), except the one it already gave."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from aaabus.config.reader import load_config
from aaabus.node.epochs import EpochBook
from aaabus.node.voter import Voter

DELAY_S = 0.5


def vote(epoch: int = 2, member: int = 1, server: int = 0) -> dict[str, object]:
    return {"op": "vote", "server": server, "epoch": epoch, "member": member, "position": "ff"}


def make_voter(
    tmp_path: Path, make_config: Callable[..., Path], started: float
) -> tuple[Voter, EpochBook]:
    config = load_config(make_config(servers=2, extra={0: '<replica index="1" port="1"/>'}))
    book = EpochBook(tmp_path / "s1")
    (tmp_path / "s1").mkdir()
    return Voter(1, config, book, lambda: None, DELAY_S, started), book


def test_a_voter_just_started_cannot_tell_and_refuses(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    voter, book = make_voter(tmp_path, make_config, time.monotonic())
    answer = voter.answer(0, vote())
    assert answer["ok"] is True and answer["granted"] is False
    assert (answer["epoch"], answer["member"]) == (1, 0)
    assert "this voter started" in str(answer["why"]) and book.granted(0) is None
    # A grant it gave before its restart is given again (the book remembers it).
    assert book.grant(0, 2, 1, float("inf"), DELAY_S).granted
    assert voter.answer(0, vote())["granted"] is True
    assert voter.answer(0, vote(3))["granted"] is False


def test_a_voter_running_for_the_delay_grants_a_server_it_never_heard(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    voter, _ = make_voter(tmp_path, make_config, time.monotonic() - DELAY_S)
    answer = voter.answer(0, vote())
    assert answer == {"ok": True, "granted": True, "epoch": 2, "member": 1, "why": "granted"}
    assert EpochBook(tmp_path / "s1").granted(0) == (2, 1)
    assert voter.answer(0, {"op": "whois", "server": 0}) == {"ok": True, "epoch": 2, "member": 1}


def test_malformed_or_foreign_requests_are_one_line(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    voter, book = make_voter(tmp_path, make_config, time.monotonic() - DELAY_S)
    for request, error in (
        ([], "a request is a JSON object"),
        ({"op": "deploy", "server": 0}, "may ask only vote or whois, not 'deploy'"),
        ({"op": "whois", "server": 1}, "about server 0 only, not 1"),
        (vote(server=1), "about server 0 only, not 1"),
        (vote(epoch=1), "'epoch' must be an integer of at least 2, not 1"),
        (vote(epoch=True), "'epoch' must be an integer"),
        (vote(member=-1), "'member' must be an integer of at least 0"),
        (vote(member=2), "server 0 has no member 2 (members: 0, 1)"),
        ({**vote(), "position": 7}, "'position' must be the hex tid"),
    ):
        answer = voter.answer(0, request)
        assert answer["ok"] is False and error in str(answer["error"]), (request, answer)
        assert "\n" not in str(answer["error"])
    assert book.known(0) is None and book.granted(0) is None
