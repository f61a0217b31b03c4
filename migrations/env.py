"""Alembic environment: URL from the config (set by jobs.migrate) or settings; metadata from jobs.models."""
from __future__ import annotations

from alembic import context
from sqlalchemy import engine_from_config, pool

from jobs.models import Base
from jobs.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().resolved_database_url
target_metadata = Base.metadata


def run_offline() -> None:
    context.configure(url=url, target_metadata=target_metadata, literal_binds=True, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connectable = engine_from_config({"sqlalchemy.url": url}, prefix="sqlalchemy.", poolclass=pool.NullPool)
    with connectable.connect() as connection:
        context.configure(connection=connection, target_metadata=target_metadata, compare_type=True,
                          render_as_batch=connection.dialect.name == "sqlite")
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
