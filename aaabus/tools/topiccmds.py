"""``aaabus publish`` and ``aaabus subscribe``: topics from the shell.

::

    aaabus publish a3.xml site/3/temp "21.5" [--via N] [--retain]
    aaabus subscribe a3.xml 'site/+/temp' [--via N] [--count K] [--name NAME]

``subscribe`` prints one payload per line on stdout, flushed at once, and acknowledges each one
when it asks for the next; with ``--name`` the subscription is durable (kept by server ``N``
across restarts) and a later ``subscribe --name`` resumes after the last payload printed. Both
run on the main thread; errors are one line on stderr and exit code 2 (1: server unreachable).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_parsers"]

Credential = Callable[[argparse.Namespace, Any], Any]


def add_parsers(sub: Any, key_help: str, credential: Credential) -> None:
    """Add both commands to ``sub`` (the ``aaabus`` subparsers); ``credential(args, config)``
    is the key file the tools authenticate with."""
    publish = sub.add_parser("publish", help="publish a text on a topic from outside the bus")
    publish.add_argument("config")
    publish.add_argument("topic", help="topic name, levels separated by /")
    publish.add_argument("text", help="the payload (published as a str)")
    publish.add_argument("--via", type=int, help="server to publish through (default: lowest id)")
    publish.add_argument("--retain", action="store_true", help="keep it as the topic's retained")
    publish.add_argument("--key", help=key_help)
    publish.add_argument("--timeout", type=float, default=30.0, help="seconds, retries included")
    publish.set_defaults(func=lambda args: _publish(args, credential))

    subscribe = sub.add_parser("subscribe", help="print the payloads published on a filter")
    subscribe.add_argument("config")
    subscribe.add_argument("filter", help="topic filter: + is one level, # the rest (quote it)")
    subscribe.add_argument("--via", type=int, help="server holding the subscription")
    subscribe.add_argument("--count", type=int, help="stop after this many (default: never)")
    subscribe.add_argument("--name", help="durable subscription name: resumes where it stopped")
    subscribe.add_argument("--key", help=key_help)
    subscribe.add_argument("--timeout", type=float, default=30.0, help="seconds per request")
    subscribe.set_defaults(func=lambda args: _subscribe(args, credential))


def _publish(args: argparse.Namespace, credential: Credential) -> int:
    from aaabus.config.reader import load_config
    from aaabus.tools.client import Client

    config = load_config(args.config)
    with Client(config, args.via, secret=credential(args, config), timeout=args.timeout) as c:
        c.publish(args.topic, args.text, retain=args.retain)
    return 0


def _subscribe(args: argparse.Namespace, credential: Credential) -> int:
    from aaabus.config.reader import load_config
    from aaabus.errors import ConfigError
    from aaabus.tools.client import Client

    if args.count is not None and args.count < 1:
        raise ConfigError(f"--count {args.count}: give a number of payloads >= 1")
    config = load_config(args.config)
    secret = credential(args, config)
    with Client(config, args.via, secret=secret, timeout=args.timeout) as client:
        subscription = client.subscribe(args.filter, args.name)
        printed = dropped = 0
        try:
            while args.count is None or printed < args.count:
                publication = next(subscription)
                print(_text(publication.payload), flush=True)
                printed += 1
                if subscription.dropped > dropped:
                    print(
                        f"aaabus subscribe: {subscription.dropped - dropped} publication(s) "
                        "dropped at the server's backlog limit (aaabus.topics.backlog)",
                        file=sys.stderr,
                    )
                    dropped = subscription.dropped
        except KeyboardInterrupt:
            pass
        finally:
            subscription.close()
    return 0


def _text(payload: Any) -> str:
    if isinstance(payload, bytes):
        return payload.decode("utf-8", "replace")
    return str(payload)
