"""The agents the benchmarks run (ping-pong, stream, groups, topics), next to the benchmarks.

Server processes that a suite starts load them by name from the config
(``perf.agents.pingpong:bench_service``), so a suite runs from the repository root, as every
suite does. Nothing but ``perf`` uses them; the wheel installs ``aaabus`` only.
"""
