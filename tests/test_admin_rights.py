"""Which admin request each scope may make (aaabus.node.rights), without a server.

The real-process checks are in tests/test_security_scopes.py; here every op of the table is
tried at every scope, and a refused request must never reach the server (``perform``).
"""

from __future__ import annotations

import base64
import pickle
from typing import Any

import pytest

from aaabus.config.scopes import Scope
from aaabus.node.rights import CARRIERS, NEEDS, Session

DATA = base64.b64encode(b"\x92\xa3tag\x80").decode()  # a MessagePack array, not a pickle
PICKLE = base64.b64encode(pickle.dumps({"any": "thing"}, protocol=5)).decode()


def ask(session: Session, request: Any, reply: dict[str, Any] | None = None) -> dict[str, Any]:
    """What the session answers (``reply``, default ok, if it lets the request through); a
    request it refuses must not have reached the server."""
    performed: list[Any] = []
    given = reply or {"ok": True}

    def perform() -> dict[str, Any]:
        performed.append(request)
        return given

    answer = session.serve(request, perform)
    assert (answer is given) == bool(performed), (answer, performed)
    return answer


@pytest.mark.parametrize("held", list(Scope))
def test_each_op_takes_its_scope(held: Scope) -> None:
    for op, needed in NEEDS.items():
        request = {"op": op, CARRIERS[op]: DATA} if op in CARRIERS else {"op": op, "name": "n"}
        answer = ask(Session(held), request)
        if held.covers(needed) or (op == "unsubscribe" and held is Scope.READ):
            # A read session's unsubscribe goes on to the mailbox desk, which knows the owner
            # (tests/test_security_admin_sessions.py has its refusals).
            assert answer == {"ok": True}, (op, answer)
        else:
            assert answer["ok"] is False
            assert answer["error"] == (
                f"{op} needs scope {needed.label}, this session holds {held.label}; use a tool "
                f"key made with `aaabus secret --tool --scope {needed.label}`"
            )


def test_read_is_status_subscribe_and_fetch_only() -> None:
    assert {op for op, s in NEEDS.items() if s is Scope.READ} == {"status", "subscribe", "fetch"}
    assert set(NEEDS.values()) == {Scope.READ, Scope.OPERATE}  # code depends on the content


@pytest.mark.parametrize("op", sorted(CARRIERS))
def test_a_pickle_is_code_whatever_the_op(op: str) -> None:
    request = {"op": op, CARRIERS[op]: PICKLE}
    answer = ask(Session(Scope.OPERATE), request)
    assert answer["ok"] is False
    assert answer["error"].startswith(f"{op} of a pickle (code, e.g. an agent by value) needs ")
    assert "scope code, this session holds operate" in answer["error"]
    assert ask(Session(Scope.CODE), request) == {"ok": True}


def test_unknown_and_malformed_requests() -> None:
    answer = ask(Session(Scope.CODE), {"op": "shell"})
    assert answer == {"ok": False, "error": "unknown request 'shell'"}
    # Not an object: left to the dispatcher, which refuses it.
    refusal = {"ok": False, "error": "a request is a JSON object"}
    assert Session(Scope.READ).serve([1], lambda: refusal) == refusal
    # A carrier's field that is not base64, or missing: no code; the decoder refuses it later.
    for bad in ("%%%%", 7, None):
        assert ask(Session(Scope.OPERATE), {"op": "send", "note": bad}) == {"ok": True}


def test_a_session_knows_which_subscriptions_it_created() -> None:
    session = Session(Scope.READ)
    mine = {"op": "subscribe", "name": "client-1", "filter": "a/#"}
    theirs = {"op": "subscribe", "name": "durable", "filter": "a/#"}
    assert ask(session, mine, {"ok": True, "existed": False})["ok"]
    assert ask(session, theirs, {"ok": True, "existed": True})["ok"]
    refused = {"ok": False, "error": "refused"}
    assert ask(session, {"op": "subscribe", "name": "late", "filter": "a/#"}, refused) == refused
    assert session.opened("client-1")
    assert not session.opened("durable") and not session.opened("late")
    # Another session of the same key did not open it.
    assert not Session(Scope.READ).opened("client-1")
