"""Runnable examples of aaabus: ``python -m examples.<name>`` from the repository root.

Each starts its own bus on free ports of 127.0.0.1, prints what happens and exits 0.
"""
