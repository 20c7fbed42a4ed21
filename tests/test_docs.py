"""The guide's Python blocks run, in order, in one session: docs that stay true."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE = ["docs/guide.md"]


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("page", RUNNABLE)
def test_every_python_block_runs(
    page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # ./persist-data/ of its own
    monkeypatch.delenv("PERSIST_BLOB_URI", raising=False)
    monkeypatch.delenv("PERSIST_CONSENSUS_URI", raising=False)
    blocks = _blocks(ROOT / page)
    assert blocks, f"{page} has no Python block"
    namespace: dict[str, object] = {"__name__": "__docs__"}
    out = io.StringIO()

    async def run_all() -> None:
        for i, code in enumerate(blocks):
            compiled = compile(
                code, f"{page} block {i + 1}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
            )
            result = eval(compiled, namespace)
            if asyncio.iscoroutine(result):
                await result

    with contextlib.redirect_stdout(out):
        asyncio.run(run_all())
    printed = out.getvalue()
    assert "first write at time 0" in printed
    assert "[('ada', 70), ('bob', 50)]" in printed  # DuckDB over the contents
    assert "bank.balances" in printed


def test_every_config_field_is_in_the_reference() -> None:
    import dataclasses

    import persist

    text = (ROOT / "docs" / "api.md").read_text()
    for field in dataclasses.fields(persist.PersistConfig):
        assert f"| `{field.name}` |" in text, f"PersistConfig.{field.name} is not in docs/api.md"
