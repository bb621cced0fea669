"""The web console: the bus live in a browser (``aaabus console a3.xml``, extra ``console``).

:mod:`~aaabus.console.command` parses the command line and checks the extra is installed before
anything imports aiohttp; :mod:`~aaabus.console.poller` reads each server's admin port from a
thread of its own, with a ``read``-scoped key; :mod:`~aaabus.console.board` keeps what they read
and shapes it into the JSON the page and scripts get; :mod:`~aaabus.console.web` serves the page
(``static/``: hand-written HTML, SVG-drawing JavaScript and CSS, shipped in the wheel), the JSON
API and the live stream. docs/operations.md, "The console", is the operator's side.
"""
