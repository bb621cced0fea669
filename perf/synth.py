"""Placeholder replaced by the module's owner."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not implemented yet")
