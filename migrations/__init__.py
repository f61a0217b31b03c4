"""Alembic migrations of the jobs store (`swarmbatch db upgrade`); env.py reads the URL from settings."""
