"""The generated pages: which file each renderer writes, writing them all, and telling which are stale."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "python -m docsgen"  # the command that rewrites every page (run from the repository root)


def _cli() -> str:
    import cli
    from docsgen import cli_reference

    return cli_reference.render(cli.app)


def _configuration() -> str:
    from docsgen import configuration

    return configuration.render()


PAGES: dict[str, Callable[[], str]] = {  # path under the repository root -> what renders it
    "docs/reference/cli.md": _cli,
    "docs/reference/configuration.md": _configuration,
}


def write_all(root: Path = ROOT) -> list[str]:
    """Write every page that differs from what renders now; the paths written."""
    written = []
    for path, render in PAGES.items():
        text = render()
        target = root / path
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text, encoding="utf-8")
            written.append(path)
    return written


def stale(root: Path = ROOT) -> list[str]:
    """The pages whose committed text differs from what renders now."""
    return [path for path, render in PAGES.items()
            if not (root / path).exists() or (root / path).read_text(encoding="utf-8") != render()]
