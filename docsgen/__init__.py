"""docsgen: the reference pages of the docs site, generated from the code so that each fact is written once.

    markdown       escaping and tables, shared by the renderers
    cli_reference  docs/reference/cli.md from the typer app (`cli.app`), walked as a click command tree
    configuration  docs/reference/configuration.md from `jobs.settings.Settings` (`settings_reference`), the
                   `serve` options of `servers.config.ServerConfig` and the options' environment variables
    pages          which file each renderer writes; writing them, and telling which are stale
    __main__       `python -m docsgen` writes the pages; `--check` only says which are stale (exit 1)

tests/test_docs.py fails when a committed page differs from what these render now.
"""
