"""The ids of the Tinker API and the ``tinker://`` paths of checkpoints, checked against strict
patterns before any path is built from them.

A path names ``tinker://<model_id>/<weights|sampler_weights>/<name>``; a model id is
``<session_id>:train:<n>``. Every pattern is matched whole (``fullmatch``), so no id or name can
hold a ``/``, a ``..`` or a newline.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tinker_server.contract import UserError

KINDS = {"weights": "training", "sampler_weights": "sampler"}  # path segment -> SDK checkpoint_type

# Matched with fullmatch: "$" would also match before a trailing newline ("name\n").
SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MODEL_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}:train:[0-9]{1,9}$")
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")


def check_session_id(session_id: object, field: str) -> str:
    """``session_id`` if well formed, else a :class:`UserError` naming ``field``."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise UserError(f"{field}: {session_id!r} is not a session id (letters, digits, '_' and '-')")
    return session_id


def check_model_id(model_id: object, field: str) -> str:
    """``model_id`` if well formed (``<session_id>:train:<n>``), else a :class:`UserError`."""
    if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
        raise UserError(f"{field}: {model_id!r} is not a model id of this server (expected '<session_id>:train:<n>')")
    return model_id


def check_name(name: object, field: str) -> str:
    """A checkpoint name: letters, digits, ``.``, ``_``, ``-`` (no ``/``, no ``..``), at most 128 chars."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise UserError(
            f"{field}: {name!r} is not a valid checkpoint name; use 1-128 letters, digits, '.', '_' or '-' "
            "(no '/', no '..', not starting with '.')"
        )
    return name


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint: the model that wrote it, its kind (path segment) and its name."""

    model_id: str
    kind: str  # "weights" or "sampler_weights"
    name: str

    @property
    def tinker_path(self) -> str:
        """``tinker://<model_id>/<kind>/<name>``."""
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """``<kind>/<name>``: the SDK's id of the checkpoint within its run."""
        return f"{self.kind}/{self.name}"

    @property
    def checkpoint_type(self) -> str:
        """The SDK's ``checkpoint_type``: ``training`` or ``sampler``."""
        return KINDS[self.kind]


def parse_tinker_path(path: object, field: str) -> CheckpointRef:
    """``tinker://<model_id>/<weights|sampler_weights>/<name>`` -> :class:`CheckpointRef`."""
    prefix = "tinker://"
    if not isinstance(path, str) or not path.startswith(prefix):
        raise UserError(f"{field}: {path!r} is not a checkpoint path; expected 'tinker://<model_id>/weights/<name>'")
    parts = path[len(prefix) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS:
        raise UserError(
            f"{field}: {path!r} is not a checkpoint path; expected 'tinker://<model_id>/weights/<name>' "
            "or 'tinker://<model_id>/sampler_weights/<name>'"
        )
    return CheckpointRef(check_model_id(parts[0], field), parts[1], check_name(parts[2], field))
