"""The documentation tells the truth: its code blocks run, and what it names exists.

What it names is checked against the code: every ``aaabus.*`` property (declared in
:mod:`aaabus.config.settings`, with the default the prose gives it), every ``aaabus`` command and
its options (the CLI's parser), every module and file docs/architecture.md points to, every
thread a server starts (the table of docs/architecture.md), the store the demo's banner names.

The code blocks of the documentation run, in order, against a real bus.

Fences say what to do with a block (the first word stays the language, for highlighting):

* ```` ```python file=NAME ```` — written to ``NAME`` in the working directory;
* ```` ```python run ```` — run with Python;
* ```` ```console run ```` — every ``$ command`` line is run by bash (``set -e``); the other lines
  are sample output and are not compared. A command ending in ``&`` keeps running in the
  background until the doc stops it (the test stops whatever is left).

Any other fence (``python``, ``console``, ``text``, ``xml``...) is illustrative and not run. All
blocks of one file share one temporary directory, and ``--base-port N`` is replaced with free
ports, so a doc can use fixed, readable numbers.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import pkgutil
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentServer
from aaabus.config import settings
from aaabus.config.reader import load_config
from aaabus.core.store import STORE_KINDS
from aaabus.tools import cli
from aaabus.tools.client import Client
from examples._bus import free_base
from tests.support.agents import Marker, Probe
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.tls import make_certificate
from tests.support.topics import wait_until

DOCS = ["README.md", "docs/tutorial.md", "docs/operations.md"]
#: Every page that describes the product (perf/RESULTS.md is a log of dated runs: what it says
#: was true of its day).
PAGES = sorted(
    {
        REPO_ROOT / "README.md",
        *(REPO_ROOT / "docs").glob("*.md"),
        *(p for p in (REPO_ROOT / "perf").glob("*.md") if p.name != "RESULTS.md"),
    }
)
ARCHITECTURE = REPO_ROOT / "docs" / "architecture.md"
FENCE = re.compile(r"^```(\w+)[ \t]*([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def runnable_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, info, body)`` of every block the test must write or run."""
    return [
        (lang, info.strip(), body)
        for lang, info, body in FENCE.findall(text)
        if info.strip() == "run" or info.strip().startswith("file=")
    ]


def console_script(body: str) -> str:
    commands = [ln[2:] for ln in body.splitlines() if ln.startswith("$ ")]
    return "set -e\n" + "\n".join(commands) + "\n"


def stop_group(pgid: int, timeout: float = 20.0) -> None:
    """SIGTERM a process group we started (aaabus launch then stops its servers), then KILL."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.killpg(pgid, signal.SIGKILL)


# Real server processes, subprocesses or Spark: not in the fast lane (make check).
@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS)
def test_doc_blocks_run(doc: str, tmp_path: Path) -> None:
    text = (REPO_ROOT / doc).read_text()
    blocks = runnable_blocks(text)
    assert blocks, f"{doc} has no runnable block"
    base = free_base(20)  # and their admin ports, +1000
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(tmp_path)
    env["PYTHONUNBUFFERED"] = "1"
    groups: list[int] = []
    log = tmp_path / "_output.log"
    try:
        with log.open("w") as out:
            for number, (lang, info, body) in enumerate(blocks):
                body = re.sub(r"--base-port \d+", f"--base-port {base}", body)
                where = f"{doc}, runnable block {number + 1} ({lang} {info})"
                if info.startswith("file="):
                    (tmp_path / info[5:]).write_text(body)
                    continue
                if lang == "python":
                    script = tmp_path / f"_block{number}.py"
                    script.write_text(body)
                    command = [sys.executable, str(script)]
                elif lang == "console":
                    command = ["bash", "-c", console_script(body)]
                else:
                    raise AssertionError(f"{where}: cannot run {lang}")
                out.write(f"--- {where}\n")
                out.flush()
                proc = subprocess.Popen(
                    command,
                    cwd=tmp_path,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # its own group: background jobs stopped with it
                )
                groups.append(proc.pid)
                try:
                    code = proc.wait(120)
                except subprocess.TimeoutExpired:
                    code = None
                assert code == 0, f"{where} failed ({code}):\n{log.read_text()[-3000:]}"
    finally:
        if (tmp_path / "a3.xml").exists():
            subprocess.run(
                [sys.executable, "-m", "aaabus", "stop", "a3.xml", "--timeout", "20"],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                timeout=60,
            )
        for pgid in groups:
            stop_group(pgid)


# -- what the pages name ---------------------------------------------------------------------

FENCE_BODY = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
#: ``aaabus.`` followed by dotted names: a property, a module or one of its attributes, a logger.
DOTTED = re.compile(r"(?<![\w/.-])aaabus(?:\.[A-Za-z_<*][\w<>*]*)+")


def page_id(page: Path) -> str:
    return str(page.relative_to(REPO_ROOT))


def is_setting(name: str) -> bool:
    if name.endswith(".*"):  # `aaabus.tls.*`: a family of properties
        return any(s.name.startswith(name[:-1]) for s in settings.SETTINGS)
    if any(s.name == name for s in settings.SETTINGS):  # `aaabus.dial.<id>`, as declared
        return True
    try:
        settings.find(name)
    except ValueError:
        return False
    return True


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module of this checkout or an attribute of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            spec = importlib.util.find_spec(module)
        except ImportError:
            spec = None
        if spec is None:
            continue
        if cut == len(parts):
            return True  # a module (never imported: `aaabus.__main__` would run the CLI)
        target: Any = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(target, attr):
                return False
            target = getattr(target, attr)
        return True
    return False


def runtime_strings() -> list[re.Pattern[str]]:
    """The other ``aaabus.*`` names the runtime uses: logger names (``{…}`` parts of f-strings
    match one name) and Parquet metadata keys, as string literals of the package."""
    found: set[str] = set()
    for source in (REPO_ROOT / "aaabus").rglob("*.py"):
        found.update(re.findall(r'"(aaabus\.[\w.{}]+)"', source.read_text()))
    return [re.compile(re.sub(r"\\\{[^}]*\\\}", r"[^.]+", re.escape(name))) for name in found]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_aaabus_name_on_a_page_exists(page: Path) -> None:
    """A property is declared, a module or attribute is importable, a logger name is used."""
    others = runtime_strings()
    unknown = [
        name
        for name in sorted(set(DOTTED.findall(page.read_text())))
        if not is_setting(name)
        and not any(rx.fullmatch(name) for rx in others)
        and not resolves(name)
    ]
    assert not unknown, f"{page_id(page)} names what does not exist: {unknown}"


# `aaabus.x` (default 100 000 …), `aaabus.x`, default `127.0.0.1`, `aaabus.x` KiB (4096 by default
_VALUE = r"`?(\d{1,3}(?: \d{3})+|[\w./-]*\w)`?"
_DEFAULT_FORMS = [
    re.compile(r"`(aaabus\.[\w.<>]+)`[^.;`]{0,30}?\(default:? " + _VALUE),
    re.compile(r"`(aaabus\.[\w.<>]+)`,? default:? " + _VALUE),
    re.compile(r"`(aaabus\.[\w.<>]+)`[^.;`]{0,30}?\(" + _VALUE + " by default"),
]


def documented_defaults(text: str) -> list[tuple[str, str]]:
    """``(property, default)`` wherever the prose gives a property's default (the reference
    table of docs/config.md is generated from the declarations and tested apart)."""
    prose = "\n".join(ln for ln in text.splitlines() if not ln.startswith("| `aaabus."))
    prose = re.sub(r"\s*\n\s*", " ", prose)
    return [(m[1], m[2]) for form in _DEFAULT_FORMS for m in form.finditer(prose)]


def test_the_defaults_the_pages_give_are_the_declared_ones() -> None:
    seen = []
    for page in PAGES:
        for name, shown in documented_defaults(page.read_text()):
            default = settings.find(name).default
            declared = str(default).lower() if isinstance(default, bool) else str(default)
            assert re.sub(r"[ ,_]", "", shown) == declared, (
                f"{page_id(page)}: {name} is said to default to {shown}, declared {declared}"
            )
            seen.append(name)
    # The forms above are the ones the pages use: if none matched, the test would test nothing.
    assert {"aaabus.topics.backlog", "aaabus.store.pack_mb", "aaabus.metrics.host"} <= set(seen)


def test_default_forms_are_read() -> None:
    text = "`aaabus.a.b` ids (default 100 000) and `aaabus.c`, default `127.0.0.1`; `aaabus.d` "
    text += "KiB (4096 by default)."
    assert documented_defaults(text) == [
        ("aaabus.a.b", "100 000"),
        ("aaabus.c", "127.0.0.1"),
        ("aaabus.d", "4096"),
    ]


def command_lines(text: str) -> list[str]:
    """Every ``aaabus …`` or ``aaabus-server …`` command of a page: lines of its code blocks
    (a ``$`` prompt or none) and inline code spans, cut at a pipe, redirection or comment."""
    lines = []
    for body in FENCE_BODY.findall(text):
        lines += [ln.strip().removeprefix("$ ") for ln in body.splitlines()]
    lines += re.findall(r"`([^`\n]+)`", FENCE_BODY.sub("", text))
    return [
        re.split(r"\s(?:\||&&|;|>|#)\s?|\s&$", line)[0]
        for line in lines
        if re.match(r"aaabus(-server)?\s", line)
    ]


def command_options() -> dict[str, set[str]]:
    """Each command of the CLI (and ``aaabus-server``) with its options."""
    subs = next(a for a in cli._main_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {
        name: {o for a in parser._actions for o in a.option_strings}
        for name, parser in subs.choices.items()
    }
    server = cli._server_parser("aaabus-server")
    options["aaabus-server"] = {o for a in server._actions for o in a.option_strings}
    return options


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_command_and_option_on_a_page_exists(page: Path) -> None:
    options = command_options()
    wrong = []
    for line in command_lines(page.read_text()):
        words = line.split()
        command = words[0] if words[0] == "aaabus-server" else words[1]
        command = re.split(r"[^\w-]", command)[0]  # `aaabus status/stop/send`: status
        if command not in options:
            wrong.append(f"no command {command!r}: {line}")
            continue
        wrong += [
            f"no option {flag} of {command}: {line}"
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", line)
            if flag not in options[command]
        ]
    assert not wrong, f"{page_id(page)}: " + "; ".join(wrong)


def test_commands_are_found_in_code_blocks_and_inline() -> None:
    text = "Run `aaabus status a3.xml --wait 60` or\n```console\n$ aaabus stop a3.xml | cat\n```\n"
    text += "then `aaabus-server --id 0`; `aaabus` alone is a word."
    assert sorted(command_lines(text)) == [
        "aaabus status a3.xml --wait 60",
        "aaabus stop a3.xml",
        "aaabus-server --id 0",
    ]


LAYERS = ("model", "wire", "config", "core", "io", "mqtt", "node", "tools", "topics", "testing")


def test_every_module_and_file_of_the_architecture_exists() -> None:
    """`core.engine` (a module of a layer, or an attribute of one), `aaabus.x.y`, and paths:
    `aaabus/…`, `tests/…`, `perf/…`, `docs/…`, `core/clock.py` (inside the package)."""
    text = ARCHITECTURE.read_text()
    layers = "|".join(LAYERS)
    short = set(
        re.findall(rf"(?<![\w./])((?:{layers})\.[a-z_][a-z_0-9]*(?:\.[a-z_][a-z_0-9]*)*)", text)
    )
    missing = [name for name in sorted(short) if not resolves(f"aaabus.{name}")]
    paths = re.findall(rf"(?<![\w./-])((?:aaabus|tests|perf|docs|{layers})/[\w/.-]*[\w/])", text)
    for path in sorted(set(paths)):
        top = path.split("/")[0]
        where = REPO_ROOT / path if top in ("aaabus", "tests", "perf", "docs") else None
        if not (where or REPO_ROOT / "aaabus" / path).exists():
            missing.append(path)
    assert len(short) > 50, "the table of modules was not read"
    assert not missing, f"docs/architecture.md names what does not exist: {missing}"


def layer_picture(block: str) -> tuple[dict[str, set[str]], list[tuple[str, str, str]]]:
    """The modules each layer's column of the architecture picture names, and its arrows
    ``(layer, importer, imported)``. A line naming ``aaabus.<layer>`` (several: columns, at the
    names' positions) starts that layer's column; the lines after it are cut at the same
    positions. Parenthesised remarks are not names."""
    names: dict[str, set[str]] = {}
    arrows: list[tuple[str, str, str]] = []
    columns: list[tuple[int, str]] = []
    for raw in block.splitlines():
        line = re.sub(r"\([^)]*\)", lambda m: " " * len(m.group()), raw)
        heads = list(re.finditer(r"aaabus\.(\w+)", line))
        if heads:
            columns = [(m.start(), m.group(1)) for m in heads]
            line = re.sub(r"aaabus\.\w+", lambda m: " " * len(m.group()), line)
        for i, (start, layer) in enumerate(columns):
            end = columns[i + 1][0] if i + 1 < len(columns) else len(line)
            tokens = re.findall(r"─►|·|\w+", line[start:end])
            names.setdefault(layer, set()).update(t for t in tokens if t not in ("─►", "·"))
            arrows += [
                (layer, tokens[j - 1], tokens[j + 1])
                for j, token in enumerate(tokens)
                if token == "─►" and 0 < j < len(tokens) - 1
            ]
    return names, arrows


def picture_errors(block: str) -> list[str]:
    """What the picture says that the import graph of ``aaabus`` does not: an arrow that is no
    import, a name that is no module of its layer, a module of a layer left out."""
    import grimp

    graph = grimp.build_graph("aaabus")
    names, arrows = layer_picture(block)
    errors = []
    for layer, importer, imported in arrows:
        if not graph.direct_import_exists(
            importer=f"aaabus.{layer}.{importer}",
            imported=f"aaabus.{layer}.{imported}",
            as_packages=True,
        ):
            errors.append(f"{layer}: {importer} ─► {imported} is not an import")
    for layer, named in names.items():
        package = importlib.import_module(f"aaabus.{layer}")
        modules = {m.name for m in pkgutil.iter_modules(getattr(package, "__path__", []))}
        errors += [f"{layer}: {name} is not one of its modules" for name in named - modules]
        errors += [f"{layer}: module {name} is left out" for name in modules - named]
    return errors


def test_the_architecture_picture_is_the_import_graph() -> None:
    block = ARCHITECTURE.read_text().split("## Layers", 1)[1].split("```", 2)[1]
    names, arrows = layer_picture(block)
    assert {"core", "io", "topics", "node", "wire", "config", "model"} <= names.keys()
    assert len(arrows) > 30, "the picture's arrows were not read"
    assert picture_errors(block) == []


def test_the_table_of_modules_has_every_module() -> None:
    text = ARCHITECTURE.read_text()
    table = text.split("The modules, one job each:", 1)[1].split("\n\n", 2)[1]
    named = set(re.findall(r"`(\w+\.\w+)`", table))
    missing = [
        f"{layer}.{module.name}"
        for layer in (*LAYERS, "analysis", "console")
        for module in pkgutil.iter_modules(importlib.import_module(f"aaabus.{layer}").__path__)
        if f"{layer}.{module.name}" not in named
    ]
    assert len(named) > 80, "the table of modules was not read"
    assert missing == [], f"docs/architecture.md's table of modules leaves out {missing}"


def test_the_picture_check_catches_a_wrong_arrow_and_a_missing_module() -> None:
    """The checker's own test: columns cut at the heads' positions, remarks skipped."""
    wrong = (
        "  aaabus.wire                 aaabus.topics\n"
        "  message ─► linkframes       mailbox ─► messages (a remark ─► x)\n"
    )
    named, arrows = layer_picture(wrong)
    assert arrows == [("wire", "message", "linkframes"), ("topics", "mailbox", "messages")]
    assert named["topics"] == {"mailbox", "messages"}  # not the remark's words
    errors = picture_errors(wrong)
    assert "wire: message ─► linkframes is not an import" in errors
    assert "topics: module trie is left out" in errors
    assert not any("mailbox ─► messages" in error for error in errors)


def thread_table(started_by: str = "") -> list[str]:
    """The thread names in the first column of docs/architecture.md's table of threads (of the
    rows whose second column holds ``started_by``, when given)."""
    section = ARCHITECTURE.read_text().split("## Threads and hand-offs", 1)[1].split("\n## ")[0]
    return [
        name
        for first, second in re.findall(r"^\| ([^|]+) \| ([^|]+) \|", section, re.M)
        if started_by in second
        for name in re.findall(r"`([^`]+)`", first)
    ]


def thread_kind(name: str) -> str:
    """``engine-0`` and ``engine-N`` alike: ids and counters (``N``, ``n``, ``k`` or digits) made
    one mark."""
    return re.sub(r"(?<=[-s])N\b|(?<=[-s])N(?=[-_])|(?<=[-_])[nk]\b|\d+", "#", name)


@pytest.fixture
def busy_servers(
    tmp_path: Path, make_config: Callable[..., Path]
) -> Iterator[tuple[list[AgentServer], set[int | None]]]:
    """Two servers with everything that starts a thread on: TLS links, the admin and metrics
    endpoints, the traffic recorder, an MQTT bridge (to a port where no broker listens: its
    thread runs and retries), a log store (s0) and a file store (s1); and the threads that ran
    before they started (the test runner's own)."""
    make_certificate(tmp_path, "bus")
    (nobody,) = free_ports(1)
    props = {
        "aaabus.tls.cert": "bus.pem",
        "aaabus.tls.key": "bus-key.pem",
        "aaabus.traffic": "traffic",
        "aaabus.metrics.port": "0",
        "aaabus.mqtt.bridge.address": f"127.0.0.1:{nobody}",
        "aaabus.mqtt.bridge.out": "#",
    }
    file_store = '<property name="aaabus.store" value="file"/>'
    config = load_config(make_config(servers=2, properties=props, extra={1: file_store}))
    servers = [
        AgentServer(config, sid, storage=tmp_path / f"s{sid}", endpoints=True) for sid in (0, 1)
    ]
    before = {t.ident for t in threading.enumerate()}
    try:
        for server in servers:
            server.start()
        yield servers, before
    finally:
        for server in servers:
            server.stop()


@pytest.mark.slow
def test_the_architecture_lists_every_thread_a_server_starts(
    busy_servers: tuple[list[AgentServer], set[int | None]],
) -> None:
    servers, before = busy_servers
    # The link between them is up (its TLS handshakes ran on the workers) before the census.
    for server in servers:

        def up(server: AgentServer = server) -> bool | None:
            return all(server.status()["links"].values()) or None

        wait_until("link up", up)
    with Client(servers[0].config, 0) as client:
        probe = client.deploy(Probe(), 1)  # over the TLS link: its handshake ran on a worker
        client.send(probe, Marker("thread census"))
        # This client's admin connection has its thread meanwhile.
        started = {t.name for t in threading.enumerate() if t.ident not in before}
    documented = {thread_kind(name) for name in thread_table()}
    observed = {thread_kind(name) for name in started}
    assert observed <= documented, f"threads missing from the table: {observed - documented}"
    # Nor does the table list a thread that is no longer started (but for the MQTT listener's,
    # which tests/test_mqtt*.py drive, and a stop request's, alive only while its server stops).
    elsewhere = {"stop-#"} | {thread_kind(name) for name in thread_table("mqtt.listener")}
    assert documented - observed <= elsewhere, f"never started: {documented - observed}"


def test_thread_names_and_the_table_compare_by_kind() -> None:
    assert thread_kind("engine-12") == thread_kind("engine-N") == "engine-#"
    assert thread_kind("net-3-tls_0") == thread_kind("net-N-tls_0") == "net-#-tls_#"
    assert thread_kind("traffic-s4") == thread_kind("traffic-sN") == "traffic-s#"
    assert thread_kind("Thread-7 (serve_forever)") == thread_kind("Thread-n (serve_forever)")
    assert thread_kind("mqtt-auth-0_1") == thread_kind("mqtt-auth-N_k") == "mqtt-auth-#_#"
    assert thread_kind("aaabus-logstore-compactor") == "aaabus-logstore-compactor"
    assert "engine-N" in thread_table() and "engine-N" not in thread_table("mqtt.listener")


def test_the_demo_banner_names_the_default_store() -> None:
    from perf import demo

    kind = settings.find("aaabus.store").default
    text = demo.banner()
    assert f"aaabus.store={kind}" in text and demo.STORE_COMMITS[kind] in text, text
    others = [words for other, words in demo.STORE_COMMITS.items() if other != kind]
    assert not any(words in text for words in others), text
    assert set(demo.STORE_COMMITS) == set(STORE_KINDS)


# -- the documentation site (mkdocs.yml, `make docs`) ----------------------------------------


def test_the_site_lists_every_page() -> None:
    """MkDocs would warn, in `make docs`, about a page left out; this says so in `make check`."""
    text = (REPO_ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"^\s*-\s[^:\n]+:\s*(\S+\.md)\s*$", text, re.M))
    docs = REPO_ROOT / "docs"
    assert listed == {str(p.relative_to(docs)) for p in docs.rglob("*.md")}


def test_the_api_reference_covers_every_part_of_the_package() -> None:
    """One `::: aaabus.X` per layer (and top-level module) of the package, and `::: aaabus`."""
    reference = "\n".join(p.read_text() for p in (REPO_ROOT / "docs" / "reference").glob("*.md"))
    shown = set(re.findall(r"^::: (aaabus(?:\.\w+)?)\s*$", reference, re.M))
    package = REPO_ROOT / "aaabus"
    parts = {
        f"aaabus.{p.stem}"
        for p in package.iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and "__" not in p.name)
    }
    assert shown == parts | {"aaabus"}, (
        f"missing: {parts - shown}, gone: {shown - parts - {'aaabus'}}"
    )
