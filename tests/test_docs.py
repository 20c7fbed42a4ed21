"""The docs stay true: every code block of README.md and docs/*.md runs (or says why not), and
the reference pages name every public call, setting, command, flag, option and Flight command.

How each block is checked is in ``tests/docs_blocks.py``; the Spark blocks run in
``tests/spark/test_docs_spark.py``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import dataclasses
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import persist
from tests.docs_blocks import (
    CI,
    PAGES,
    PYTHON,
    ROOT,
    SHELL,
    SKIPPED,
    SPARK,
    TEXT,
    Session,
    blocks,
    cli_parser,
    kind,
    subcommands,
)

# --- every block runs --------------------------------------------------------------------------


def test_every_block_is_run_or_marked() -> None:
    """Every fenced block of every page is run, checked, output (```text) or marked."""
    kinds: dict[str, list[str]] = {}
    for page in PAGES:
        for block in blocks(page):
            kinds.setdefault(kind(block), []).append(block.where)
    # The exceptions are exactly these, CI's set-up commands and the soak run: a new skip has to
    # be argued for here, so that skipping stays rare.
    assert len(kinds.get(CI, [])) == 1, kinds.get(CI)
    assert len(kinds.get(SKIPPED, [])) == 1, kinds.get(SKIPPED)
    assert kinds.get(PYTHON) and kinds.get(SHELL) and kinds.get(SPARK) and kinds.get(TEXT)


def test_a_block_neither_run_nor_marked_fails(tmp_path: Path) -> None:
    # The classification itself must be able to fail, or the test above proves nothing.
    from tests import docs_blocks

    for text in ("```\nsome code\n```\n", "```sh\nls -l\n```\n", "```rust\nfn x() {}\n```\n"):
        (tmp_path / "page.md").write_text(text)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(docs_blocks, "ROOT", tmp_path)
            (block,) = docs_blocks.blocks("page.md")
        with pytest.raises(AssertionError):
            kind(block)


def _runs(page: str) -> bool:
    for block in blocks(page):
        try:
            if kind(block) in (PYTHON, SHELL):
                return True
        except AssertionError:
            return True  # the page's test fails on it, naming the block
    return False


class Kit:
    """What the pages' hidden preludes may use: a Flight server and a stand-in consumer."""

    def __init__(self, stack: contextlib.ExitStack, root: Path) -> None:
        self._stack = stack
        self._root = root
        self.committed: list[int] = []

    def flight_server(self, token: str | None = None) -> str:
        """Starts ``persist serve`` (in this process, on a loop thread of its own and its own
        location); its URI."""
        from persist.bridge import LoopThread
        from persist.flight import FlightServer

        where = self._root / "flight"
        where.mkdir(exist_ok=True)

        async def start() -> FlightServer:
            server = FlightServer(
                where.joinpath("blob").as_uri(),
                f"sqlite://{where / 'consensus.db'}",
                port=0,
                token=token,
                wal_dir=where / "wal",
                drain_grace_s=0,
            )
            await server.start()
            return server

        thread = LoopThread("docs-flight")
        self._stack.callback(thread.close)
        server = thread.run(start())
        self._stack.callback(lambda: thread.run(server.stop()))
        return str(server.uri)

    def consumer(self) -> Any:
        kit = self

        class Consumer:
            def commit(self, offset: int) -> None:
                kit.committed.append(offset)

        return Consumer()


# What each page's blocks print (or leave behind) that only a real run gives.
EXPECTED_OUTPUT = {
    "README.md": ['user: [["ada"]]', "balance: [[100]]", "up to 2 changes: 2"],
    "docs/api.md": [
        "refused: the upper is 1",
        "upper 4",
        "\n5\n6\n3\n",
        "True ['batches_rewritten', 'blobs_deleted', 'blobs_held', 'bytes_after'",  # erase
        "[('b2', 7), ('c3', 9)]",  # schema evolution: a1 of version 0 retracted at version 1
        "refused: field 'price' can't change from int64 to int16",
        "changed: 0 1",
    ],
    "docs/cli.md": [
        "persist 0.1.0\n",  # --version
        "a stale writer was refused: UpperMismatch",  # persist demo
        '{"retention_s": 3600.0}',
        '"batches_rewritten"',  # persist purge's report
        '"rows_erased": 2',  # persist erase: ada's insert and its retraction
        "sales.orders is now named sales.orders_v2",
        "dropped sales.orders_v2",
        "version 0 (current)  made ",  # persist schema
    ],
    "docs/lifecycle.md": [
        "0 2\n",
        "retracted 1\n",
        "['batches_rewritten', 'blobs_deleted'",
        "3 3000 damaged\n4 75 None\n[None, None, None, None]\n",  # changing a shard's shape
        "retracted 1\n[2, 3, 4]\nversion 0  made ",
        "version 2 (current)  made ",
    ],
    "docs/guide.md": [
        "first write at time 0",
        "[('ada', 70), ('bob', 50)]",  # DuckDB over the contents
        "bank.balances",
        '"rows": 2',  # persist export's report
        "dropped bank.balances",
    ],
}


@pytest.mark.parametrize("page", [p for p in PAGES if _runs(p)])
def test_every_block_of_the_page_runs(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # ./persist-data/ of its own
    monkeypatch.delenv("PERSIST_BLOB_URI", raising=False)
    monkeypatch.delenv("PERSIST_CONSENSUS_URI", raising=False)
    monkeypatch.delenv("PERSIST_FLIGHT_TOKEN", raising=False)
    ran = 0
    with contextlib.ExitStack() as stack:
        kit = Kit(stack, tmp_path)
        session = Session(page, {"docs_kit": kit})
        stack.callback(session.close)
        for block in blocks(page):
            if kind(block) in (PYTHON, SHELL):
                session.run(block)
                ran += 1
    assert ran
    printed = session.out.getvalue()
    for expected in EXPECTED_OUTPUT.get(page, []):
        assert expected in printed, f"{page} did not print {expected!r}:\n{printed}"
    if page == "README.md":
        assert kit.committed == [41]  # on_durable's callback ran once LOCAL_DISK was reached


# --- the Python reference ----------------------------------------------------------------------


def _code(text: str) -> str:
    """The code on a page: fenced blocks and inline spans."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return "\n".join(fenced + re.findall(r"`([^`]+)`", rest))


def _public(cls: type, instance: object = None) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    for base in (object, str, int):
        if issubclass(cls, base) and cls is not base:
            names -= set(dir(base))
    if instance is not None:
        names |= {n for n in vars(instance) if not n.startswith("_")}
    return names


async def _instances() -> tuple[Any, Any, Any]:
    import pyarrow as pa

    client = await persist.connect("mem://docs-reference", "mem://docs-reference")
    write, read = await client.open(persist.ShardId.new(), pa.schema([("x", pa.int64())]))
    await client.close()
    return client, write, read


def test_api_reference_names_every_public_call() -> None:
    """Each public method, property and attribute, written the way a caller writes it
    (``client.purge``, ``write.upper``, ``persist.Split.from_bytes``), in api.md or a page it
    links for it (lifecycle.md); each name ``persist`` exports, in backticks."""
    from persist.write import BatchBuilder

    text = (ROOT / "docs" / "api.md").read_text()
    assert "](lifecycle.md)" in text
    code = _code(text + (ROOT / "docs" / "lifecycle.md").read_text())
    client, write, read = asyncio.run(_instances())
    receivers: list[tuple[type, object, tuple[str, ...]]] = [
        (persist.PersistClient, client, ("client",)),
        (persist.WriteHandle, write, ("write",)),
        (persist.ReadHandle, read, ("read",)),
        (BatchBuilder, None, ("builder",)),
        (persist.Batch, None, ("batch", "persist.Batch")),
        (persist.Split, None, ("split", "persist.Split")),
        (persist.ListenEvent, None, ("event",)),
        (persist.ShardId, None, ("persist.ShardId",)),
    ]
    missing = []
    for cls, instance, names in receivers:
        for member in sorted(_public(cls, instance)):
            said = "|".join(re.escape(n) for n in names)
            if not re.search(rf"(?<![\w.])(?:{said})\.{member}\b", code):
                missing.append(f"{names[0]}.{member}")
    api_code = _code(text)
    missing += [n for n in persist.__all__ if not re.search(rf"\b{n}\b", api_code)]
    assert not missing, f"docs/api.md does not document {missing}"


def test_api_reference_names_every_optional_parameter() -> None:
    """Each optional parameter of a public call is named in a paragraph (or list item) that
    names the call: a new keyword (say ``timeout=``) can't go undocumented."""
    from persist.write import BatchBuilder

    text = (ROOT / "docs" / "api.md").read_text() + (ROOT / "docs" / "lifecycle.md").read_text()
    paragraphs = re.split(r"\n\s*\n|\n(?=\s*- )", text)
    missing = []
    for cls, receiver in (
        (persist.PersistClient, "client"),
        (persist.WriteHandle, "write"),
        (persist.ReadHandle, "read"),
        (BatchBuilder, "builder"),
    ):
        for name in sorted(_public(cls)):
            call = getattr(cls, name)
            if not callable(call):
                continue
            here = [p for p in paragraphs if re.search(rf"\b{receiver}\.{name}\b", p)]
            for param in inspect.signature(call).parameters.values():
                if param.default is param.empty:
                    continue
                if not any(re.search(rf"\b{param.name}\b", p) for p in here):
                    missing.append(f"{receiver}.{name}({param.name}=)")
    assert not missing, f"docs/api.md does not name {missing} where it describes the call"


def test_every_config_field_is_in_the_reference() -> None:
    """Each ``PersistConfig`` field has a row in api.md's table, with its real default."""
    text = (ROOT / "docs" / "api.md").read_text()
    units = {"": 1, " KiB": 1 << 10, " MiB": 1 << 20}
    for field in dataclasses.fields(persist.PersistConfig):
        row = re.search(rf"^\| `{field.name}` \| ([^|]+) \|", text, flags=re.M)
        assert row, f"PersistConfig.{field.name} is not in docs/api.md"
        cell = row.group(1).strip()
        if callable(field.default):
            continue  # the wall clock: said in words
        number = re.fullmatch(r"([\d.]+)( KiB| MiB)?", cell)
        shown = float(number[1]) * units[number[2] or ""] if number else cell
        assert shown == field.default or str(field.default) == cell, (
            f"docs/api.md gives PersistConfig.{field.name} the default {cell}, "
            f"not {field.default!r}"
        )


# --- the command line --------------------------------------------------------------------------


def _sections(text: str) -> dict[str, str]:
    """A page's ``##`` sections by heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _shown(default: object) -> str:
    if isinstance(default, float) and default.is_integer():
        return str(int(default))
    return str(default)


def _has_default(action: argparse.Action) -> bool:
    # The retention command's SECONDS defaults to a private sentinel: "show, don't set".
    return action.default not in (None, False, "", argparse.SUPPRESS) and type(action.default) in (
        str,
        int,
        float,
    )


def test_cli_reference_names_every_command_flag_and_default() -> None:
    """docs/cli.md has a section per subcommand naming each of its arguments and flags, each
    flag with its default where it has one; a flag every subcommand takes is in "Every
    command" once. README and api.md link the page."""
    text = (ROOT / "docs" / "cli.md").read_text()
    sections = _sections(text)
    parser = cli_parser()
    commands = subcommands(parser)
    shared = set.intersection(*(set(p._option_string_actions) for p in commands.values()))
    assert {"--blob", "--consensus", "--help"} <= shared
    common = sections["Every command"]
    problems = [] if "`persist --version`" in text else ["persist --version"]
    for flag in sorted(shared):
        if f"`{flag}" not in common:
            problems.append(f"{flag} (in Every command)")
    for name, sub in commands.items():
        section = sections.get(f"`persist {name}`")
        if section is None:
            problems.append(f"a section `persist {name}`")
            continue
        for action in sub._actions:
            if not action.option_strings:
                label = action.metavar or action.dest
                if not re.search(rf"`[^`]*\b{re.escape(str(label))}\b[^`]*`", section):
                    problems.append(f"persist {name}: argument {label}")
                continue
            flag = max(action.option_strings, key=len)
            if flag in shared:
                continue
            rows = [line for line in section.splitlines() if line.startswith(f"| `{flag}")]
            if not rows:
                problems.append(f"persist {name}: a row for {flag}")
            elif _has_default(action) and f"`{_shown(action.default)}`" not in rows[0]:
                problems.append(f"persist {name} {flag}: its default {_shown(action.default)}")
    assert not problems, f"docs/cli.md lacks {problems}"
    for page in ("README.md", "docs/api.md"):
        assert re.search(r"\]\((?:docs/)?cli\.md\)", (ROOT / page).read_text()), page


def test_cli_help_shows_every_default() -> None:
    for name, sub in subcommands(cli_parser()).items():
        help_text = " ".join(sub.format_help().split())
        assert sub.description, f"persist {name} --help has no description"
        for action in sub._actions:
            if action.option_strings and _has_default(action):
                shown = {str(action.default), _shown(action.default)}
                assert any(f"default: {s}" in help_text for s in shown), (
                    f"persist {name} --help does not show {action.option_strings[0]}'s default"
                )


# --- front ends --------------------------------------------------------------------------------


def test_every_spark_option_is_in_the_options_table() -> None:
    from persist.spark._options import _KNOWN

    section = _sections((ROOT / "docs" / "spark.md").read_text())["Options"]
    documented = {m.lower() for m in re.findall(r"^\| `(\w+)` \|", section, flags=re.M)}
    assert documented == set(_KNOWN), (
        f"undocumented: {sorted(set(_KNOWN) - documented)}; "
        f"not options: {sorted(documented - set(_KNOWN))}"
    )


def _command_keys() -> set[str]:
    """Every key a Flight command or action body may hold: the sets ``_protocol`` checks them
    against (``_only(obj, {...}, what)``)."""
    source = (ROOT / "persist" / "flight" / "_protocol.py").read_text()
    keys: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_only":
            keys |= ast.literal_eval(node.args[1]) if isinstance(node.args[1], ast.Set) else set()
    return keys


def test_every_flight_command_and_action_is_documented() -> None:
    import pyarrow.flight as fl

    from persist.flight._protocol import ACTIONS
    from persist.flight._service import Service

    text = (ROOT / "docs" / "flight.md").read_text()
    keys = _command_keys()
    assert {"shard", "as_of", "listen", "contents", "op", "expected_upper"} <= keys
    missing = [f'"{k}"' for k in sorted(keys) if f'"{k}"' not in text]
    actions = _sections(text)["Actions"]
    missing += [f"action {n}" for n, _ in ACTIONS if not re.search(rf"^- `{n}` ", actions, re.M)]
    rpcs = [n for n in vars(Service) if n in vars(fl.FlightServerBase) and not n.startswith("_")]
    assert "do_exchange" in rpcs
    for rpc in rpcs:
        camel = "".join(w.title() for w in rpc.split("_"))
        if f"{camel}(" not in text and f"`{camel}`" not in text:
            missing.append(camel)
    if '"op": "streaming_write"' not in text:
        missing.append('"op": "streaming_write"')
    assert not missing, f"docs/flight.md does not document {missing}"


def test_where_s3_credentials_come_from(monkeypatch: pytest.MonkeyPatch) -> None:
    """api.md's "S3 credentials" says where boto3 (every blob call) and pyarrow's
    S3FileSystem (``read.dataset``) get credentials, endpoint and region, and what it says of
    the region holds."""
    from persist.location import _S3_PARAMS, open_blob, s3

    text = _sections((ROOT / "docs" / "api.md").read_text())["S3 credentials"]
    for param in sorted(_S3_PARAMS):  # every parameter an s3:// URI accepts
        assert f"- `{param}`" in text or f"`{param}` (" in text, f"{param} is not described"
    for default in (s3.CONNECT_TIMEOUT_S, s3.READ_TIMEOUT_S, s3.MAX_ATTEMPTS):
        assert f"default {_shown(default)}" in text, f"the default {default} is not said"
    for fact in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "~/.aws/credentials",
        "~/.aws/config",
        "instance",
        "AWS_ENDPOINT_URL",
        "endpoint_url",
        "region",
        "us-east-1",
        "S3FileSystem",
        "read.dataset",
        "hadoop-aws",
    ):
        assert fact in text, f'api.md\'s "S3 credentials" does not say {fact!r}'
    # The region is the URI's, else us-east-1, whatever the environment says.
    monkeypatch.setenv("AWS_REGION", "ap-south-1")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "ap-south-1")
    for uri, region in (
        ("s3://bucket/prefix", "us-east-1"),
        ("s3://bucket/prefix?endpoint_url=http://127.0.0.1:9&region=eu-west-3", "eu-west-3"),
    ):
        where = open_blob(uri).arrow_location()
        assert where is not None and where[0].region == region
    assert "S3 credentials" in (ROOT / "README.md").read_text()


# --- links -------------------------------------------------------------------------------------


def _links(page: str) -> Iterator[str]:
    text = re.sub(r"^```.*?^```", "", (ROOT / page).read_text(), flags=re.S | re.M)
    yield from re.findall(r"\]\(([^)\s]+)\)", text)


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_points_into_the_repository() -> None:
    """Each relative link of README.md and docs/*.md names a file of the repository (not one
    beside it), and each ``#anchor`` into a page a heading of that page."""
    broken = []
    for page in PAGES:
        for target in _links(page):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            file, _, anchor = target.partition("#")
            path = (ROOT / page).parent.joinpath(file).resolve() if file else ROOT / page
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page}: {target}")
            elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
                broken.append(f"{page}: {target} (no such heading)")
    assert not broken, f"links to nothing in the repository: {broken}"
