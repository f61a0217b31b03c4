"""`python -m docsgen`: write the generated pages of docs/; `python -m docsgen --check`: list the stale ones, exit 1."""
from __future__ import annotations

import sys

from docsgen.pages import REGENERATE, stale, write_all


def main(argv: list[str]) -> int:
    """Write the pages (or, with --check, only report the stale ones); the exit status."""
    if "--check" in argv:
        old = stale()
        for path in old:
            print(f"{path} is stale: run `{REGENERATE}` and commit it")
        return 1 if old else 0
    for path in write_all():
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
