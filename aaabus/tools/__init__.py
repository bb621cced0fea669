"""The tools: the client, the local launcher and the ``aaabus`` command line.

Top of the layering: nothing in aaabus imports them except the public surface."""
