"""The code blocks of README.md and docs/*.md, and how each is checked.

Every fenced block is one of:

- ```python: run, in page order, in one namespace per page (top-level ``await`` allowed: such a
  block runs on the page's event loop, as in a notebook; a block without ``await`` runs as a
  script would, so ``asyncio.run`` and ``persist.read_table`` work in it);
- ```sh / ```console: each ``persist ...`` command is run in-process (``persist serve`` is
  parsed against the real parser instead of started); any other command fails the check;
- ```text: output or a diagram, not code;

and an HTML comment just before the fence may say otherwise:

- ``<!-- docs-test: skip: WHY -->``: not run, for the reason given;
- ``<!-- docs-test: spark -->``: a Python block run by ``tests/spark/test_docs_spark.py``, with a
  real SparkSession;
- ``<!-- docs-test: prelude`` + code + ``-->``: hidden setup run just before the block;
- README's ``<!-- setup -->``: the set-up commands ``.ci/run`` runs.

A block that fits none of these fails ``tests/test_docs.py``.
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import contextlib
import io
import os
import re
import shlex
import signal
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md")))]

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.S | re.M)
_MARK = "docs-test:"


@dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    comments: tuple[str, ...]  # the HTML comments right before the fence, in order

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def markers(self) -> list[tuple[str, str]]:
        """``(verb, rest)`` of each ``docs-test:`` comment."""
        found = []
        for comment in self.comments:
            if comment.startswith(_MARK):
                verb, rest = [*comment[len(_MARK) :].strip().split(None, 1), ""][:2]
                found.append((verb.rstrip(":"), rest.strip()))
        return found

    @property
    def prelude(self) -> str:
        return "\n".join(rest for verb, rest in self.markers() if verb == "prelude")

    def has(self, verb: str) -> bool:
        return any(v == verb for v, _ in self.markers())


def blocks(page: str) -> list[Block]:
    text = (ROOT / page).read_text()
    found = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip()
        comments: list[str] = []
        while before.endswith("-->") and "<!--" in before:
            start = before.rfind("<!--")
            comments.insert(0, before[start + 4 : -3].strip())
            before = before[:start].rstrip()
        found.append(
            Block(
                page,
                text.count("\n", 0, m.start()) + 1,
                m.group(1).strip(),
                m.group(2),
                tuple(comments),
            )
        )
    return found


# How a block is checked: the kinds below, or a reason it can't be (a failure).
PYTHON, SPARK, SHELL, TEXT, SKIPPED, CI = "python", "spark", "shell", "text", "skipped", "ci"
_VERBS = {"skip", "spark", "prelude"}


def kind(block: Block) -> str:
    """How ``block`` is checked; ``AssertionError`` (naming it) when it is not."""
    verbs = [v for v, _ in block.markers()]
    unknown = set(verbs) - _VERBS
    assert not unknown, f"{block.where}: unknown docs-test marker(s) {sorted(unknown)}"
    if "setup" in block.comments:
        assert block.page == "README.md", f"{block.where}: only README's set-up block is CI's"
        return CI
    if "skip" in verbs:
        reason = next(rest for v, rest in block.markers() if v == "skip")
        assert reason, f"{block.where}: a skipped block must say why"
        return SKIPPED
    if block.lang == "python":
        return SPARK if "spark" in verbs else PYTHON
    assert "spark" not in verbs and "prelude" not in verbs, (
        f"{block.where}: spark and prelude markers are for python blocks"
    )
    if block.lang in ("sh", "console"):
        for line in commands(block):
            argv = _argv(line)[1]
            assert argv[:1] == ["persist"], (
                f"{block.where}: {line!r} is not a persist command: run it or mark the block "
                "<!-- docs-test: skip: WHY -->"
            )
        return SHELL
    assert block.lang == "text", (
        f"{block.where}: a ```{block.lang} block is neither run nor marked: use python, sh, "
        "console or text (output, diagrams), or mark it <!-- docs-test: skip: WHY -->"
    )
    return TEXT


def commands(block: Block) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and (in a console
    block) output lines left out, ``$ `` prompts taken off."""
    joined = re.sub(r"\\\n\s*", " ", block.code)
    found = []
    for raw in joined.splitlines():
        line = raw.strip()
        if block.lang == "console":
            if not line.startswith("$ "):
                continue  # output
            line = line[2:].strip()
        if line and not line.startswith("#"):
            found.append(line)
    return found


def _argv(line: str) -> tuple[dict[str, str], list[str]]:
    """A command's leading ``VAR=value`` assignments and its words."""
    words = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
    env: dict[str, str] = {}
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


# --- the persist command ---------------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def cli_parser() -> argparse.ArgumentParser:
    """The real parser ``persist.cli.main`` builds (caught as it parses, before it runs)."""
    from persist import cli

    def catch(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Parsed(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(argparse.ArgumentParser, "parse_args", catch)
        try:
            cli.main(["--version"])
        except _Parsed as parsed:
            return parsed.parser
    raise AssertionError("persist.cli.main never parsed its arguments")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("persist has no subcommands")


def check_serve(block: Block, line: str, serve: argparse.ArgumentParser) -> None:
    """Every flag a ``persist serve`` line uses exists, and where a synopsis shows an optional
    flag with a value (``[--host 127.0.0.1]``), that value is the flag's default."""
    options = serve._option_string_actions
    for word in _argv(line)[1][2:]:
        if word.startswith("--"):
            assert word.split("=")[0] in options, f"{block.where}: persist serve has no {word}"
    for flag, shown in re.findall(r"\[(--[\w-]+) ([^\s\]]+)\]", line):
        action = options[flag]
        if action.default is None:
            continue  # a placeholder (--token T), not a default
        convert = action.type if callable(action.type) else str
        value = shown.split("|")[0]
        default = convert(action.default) if isinstance(action.default, str) else action.default
        assert convert(value) == default, (
            f"{block.where}: shows {flag} {shown}, but its default is {action.default!r}"
        )


# --- running a page ----------------------------------------------------------------------------


BLOCK_LIMIT_S = 120.0


class Session:
    """One page's namespace, event loop and printed output."""

    def __init__(self, page: str, names: Mapping[str, object] | None = None) -> None:
        self.page = page
        self.namespace: dict[str, Any] = {"__name__": "__docs__", **(names or {})}
        self.loop = asyncio.new_event_loop()
        self.out = io.StringIO()
        self._serve: argparse.ArgumentParser | None = None

    def python(self, code: str, where: str) -> None:
        compiled = compile(code, where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        with contextlib.redirect_stdout(self.out):
            result = eval(compiled, self.namespace)
            if asyncio.iscoroutine(result):
                self.loop.run_until_complete(result)

    def shell(self, block: Block) -> None:
        from persist import cli

        for line in commands(block):
            env, argv = _argv(line)
            if argv[1:2] == ["serve"]:
                if self._serve is None:
                    self._serve = subcommands(cli_parser())["serve"]
                check_serve(block, line, self._serve)
                continue
            # $PWD as a shell has it: the test's working directory, not the one pytest began in.
            known = {**os.environ, "PWD": os.getcwd()}
            assigned = {k: _expand(v, known) for k, v in env.items()}
            with pytest.MonkeyPatch.context() as mp:
                for name, value in assigned.items():
                    mp.setenv(name, value)
                args = [_expand(a, {**known, **assigned}) for a in argv[1:]]
                with contextlib.redirect_stdout(self.out):
                    try:
                        status = cli.main(args)
                    except SystemExit as exc:  # --help, --version
                        status = exc.code if isinstance(exc.code, int) else 1
            assert status == 0, f"{block.where}: {line!r} exited {status}"

    def run(self, block: Block, limit_s: float = BLOCK_LIMIT_S) -> None:
        # A block that waits forever (a listen nothing ever wakes) must fail, not stall CI.
        with _time_limit(limit_s, block.where):
            if block.prelude:
                self.python(block.prelude, f"{block.where} (prelude)")
            if block.lang == "python":
                self.python(block.code, block.where)
            else:
                self.shell(block)

    def close(self) -> None:
        """Closes the clients the page left open, then the loop."""
        from persist import PersistClient

        for value in list(self.namespace.values()):
            if isinstance(value, PersistClient):
                self.loop.run_until_complete(value.close())
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@contextlib.contextmanager
def _time_limit(seconds: float, where: str) -> Iterator[None]:
    """``TimeoutError`` naming the block once ``seconds`` pass (SIGALRM: the main thread)."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{where} ran for more than {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _expand(word: str, env: Mapping[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` as a shell expands them (unset: empty)."""
    return re.sub(r"\$(?:\{(\w+)\}|(\w+))", lambda m: env.get(m[1] or m[2], ""), word)
