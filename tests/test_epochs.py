"""The memory of epochs and grants of a server (aaabus.node.epochs), on real files, and the
EPOCH frame (aaabus.wire.frames): what a voter promised survives its restart, each epoch of a
server is given to one member, a candidate retrying gets the same answer, an older epoch is
refused; a damaged or unwritable file is one line and changes nothing."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest

from aaabus.errors import StoreError, WireError
from aaabus.node.epochs import FILE_NAME, EpochBook
from aaabus.wire.frames import decode_epoch, encode_epoch

INF = float("inf")
DELAY = 1.5


def test_a_grant_survives_a_restart(tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    answer = book.grant(3, 2, 1, INF, DELAY)
    assert (answer.granted, answer.epoch, answer.member) == (True, 2, 1)
    path = tmp_path / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = EpochBook(tmp_path)  # the voter restarted
    assert again.known(3) == (2, 1)
    assert again.granted(3) == (2, 1)
    refused = again.grant(3, 2, 2, INF, DELAY)
    assert not refused.granted and (refused.epoch, refused.member) == (2, 1)
    assert "epoch 2 is not newer" in refused.why


def test_one_grant_per_server_and_epoch_even_to_candidates_asking_at_once(
    tmp_path: Path,
) -> None:
    book = EpochBook(tmp_path)
    answers = []
    start = threading.Barrier(8)

    def ask(member: int) -> None:
        start.wait()
        answers.append(book.grant(3, 2, member, INF, DELAY))

    threads = [
        threading.Thread(target=ask, args=(member,), name=f"candidate-{member}")
        for member in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    granted = [a for a in answers if a.granted]
    assert len(answers) == 8 and len(granted) == 1
    winner = granted[0].member
    assert EpochBook(tmp_path).granted(3) == (2, winner)
    # Another server's epochs are its own business.
    assert book.grant(4, 2, 5, INF, DELAY).granted


def test_the_same_grant_asked_again_is_granted_again(tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    assert book.grant(3, 2, 1, INF, DELAY).granted
    # The candidate did not get the answer and asks again, after the new primary already
    # linked (heard from within the delay): the same answer, it was given already.
    retry = book.grant(3, 2, 1, 0.0, DELAY)
    assert retry.granted and (retry.epoch, retry.member) == (2, 1)
    assert not book.grant(3, 2, 0, INF, DELAY).granted


def test_a_lower_or_equal_epoch_is_refused(tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    assert book.raise_to(3, 5, 0)
    for epoch in (1, 4, 5):
        answer = book.grant(3, epoch, 1, INF, DELAY)
        assert not answer.granted and (answer.epoch, answer.member) == (5, 0), epoch
        assert f"server 3 is at epoch 5 (member 0) here: epoch {epoch} is not newer" in answer.why
    # Epoch 1 is member 0's without a vote: never granted, even by a voter that knows nothing.
    assert not EpochBook(None).grant(3, 1, 1, INF, DELAY).granted


def test_a_server_heard_within_the_delay_is_not_taken_over(tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    answer = book.grant(3, 2, 1, 0.2, DELAY)
    assert not answer.granted and (answer.epoch, answer.member) == (1, 0)
    assert "heard from 0.200 s ago, within the failover delay of 1.5 s" in answer.why
    assert not (tmp_path / FILE_NAME).exists()  # a refusal writes nothing
    assert book.grant(3, 2, 1, DELAY, DELAY).granted


def test_raise_to_keeps_the_newest_and_writes_only_a_change(tmp_path: Path) -> None:
    book = EpochBook(tmp_path)
    assert not book.raise_to(3, 1, 0)  # where every server starts: nothing to remember
    assert book.known(3) is None and not (tmp_path / FILE_NAME).exists()
    assert book.raise_to(3, 4, 2)
    assert not book.raise_to(3, 3, 1)
    assert not book.raise_to(3, 4, 2)
    # The same epoch held by another member than this book guessed (it granted epoch 4 to a
    # candidate that lost; the winner's link says so).
    assert book.raise_to(3, 4, 1)
    assert EpochBook(tmp_path).known(3) == (4, 1)
    assert EpochBook(tmp_path).everything() == {3: (4, 1)}


def test_a_damaged_file_is_one_line(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text('{"format": 1, "servers": {"3": {"known": [0, 1]}}}')
    with pytest.raises(StoreError) as info:
        EpochBook(tmp_path)
    line = str(info.value)
    assert "\n" not in line and f"epoch file {tmp_path / FILE_NAME} is damaged" in line
    (tmp_path / FILE_NAME).write_bytes(b"\xff\x00garbage")
    with pytest.raises(StoreError, match="cannot be read"):
        EpochBook(tmp_path)


def test_a_failed_write_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    book = EpochBook(tmp_path / "gone")  # a directory that does not exist: every write fails
    with pytest.raises(StoreError) as info:
        book.grant(3, 2, 1, INF, DELAY)
    assert "\n" not in str(info.value) and "cannot be written" in str(info.value)
    assert book.known(3) is None and book.granted(3) is None
    with pytest.raises(StoreError):
        book.raise_to(3, 2, 1)
    assert book.known(3) is None


def test_the_epoch_frame_round_trips_and_anything_else_is_one_line() -> None:
    assert decode_epoch(encode_epoch(7, 2)) == (7, 2)
    assert len(encode_epoch(2**64 - 1, 2**32 - 1)) == 13
    for payload in (b"", b"E", encode_epoch(1, 0) + b"x", b"D" + encode_epoch(1, 0)[1:]):
        with pytest.raises(WireError, match="the first frame of a link must be EPOCH"):
            decode_epoch(payload)
    with pytest.raises(WireError, match="epoch 0"):
        decode_epoch(encode_epoch(0, 0))
    # Garbage of any size is refused by its length alone.
    with pytest.raises(WireError, match="not 16777216 bytes"):
        decode_epoch(b"E" * (16 << 20))
