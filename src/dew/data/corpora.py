"""Text every Python install carries, for runs that must need no download and no data folder.

`dew demo`, the benchmarks and tests that want real English read it from here, so they all train on
the same bytes.
"""

from __future__ import annotations

HELP_TOPICS = "pydoc_data.topics (the text of Python's help topics)"


def help_topics_text() -> str:
    """Python's own help topics (`pydoc_data.topics`, about 460 KB of English from the reference
    manual), joined in sorted topic order with a blank line between topics."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))
