"""The line a server process prints on stdout once it serves (a leaf: imports nothing).

``aaabus-server`` (:mod:`aaabus.tools.cli`) prints it; the launcher (:mod:`aaabus.tools.launch`)
waits for it. Both import it from here so that neither imports the other.
"""

READY_LINE = "AgentServer#{id} started"

#: What a replica of a server (``aaabus-server --id N --replica K``) prints once it listens for
#: its primary.
REPLICA_READY_LINE = "AgentServer#{id} replica {index} started"
