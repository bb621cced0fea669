"""The programming model: agents, notifications, agent ids and the reaction context.

Pure Python and persistent classes; imports nothing else of aaabus but ``aaabus.errors``."""
