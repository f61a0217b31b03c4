"""`Settings`: the one typed configuration, read from SWARMBATCH_* environment variables."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import NoDecode
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Process-wide settings; CLI flags override them per command."""

    model_config = SettingsConfigDict(env_prefix="SWARMBATCH_", extra="ignore")

    home: Path = Field(default=Path.home() / ".swarmbatch", description="embedded state: models, SQLite, broker")
    initial_peers: Annotated[list[str], NoDecode] = Field(default_factory=list, description="DHT multiaddrs, comma-separated in env")
    database_url: str | None = None
    broker_url: str | None = None

    @field_validator("initial_peers", mode="before")
    @classmethod
    def _split_peers(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.replace(",", " ").split() if p]
        return value

    @property
    def models_dir(self) -> Path:
        """Where prepared models are cached."""
        return self.home / "models"


@lru_cache
def get_settings() -> Settings:
    """The settings of this process, validated once."""
    return Settings()
