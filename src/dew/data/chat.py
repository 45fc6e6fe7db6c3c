"""Conversation roles: each token of a chat row carries the role of the turn it belongs to."""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    """The role of a token's turn. 0 marks tokens outside any turn (padding, template glue)."""

    NONE = 0
    SYSTEM = 1
    USER = 2
    ASSISTANT = 3
    TOOL = 4
