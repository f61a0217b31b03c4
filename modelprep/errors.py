"""The one exception type raised by modelprep."""

from __future__ import annotations


class ModelPrepError(Exception):
    """A model could not be prepared or validated; the message says what to do."""
