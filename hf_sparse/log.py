"""Warnings that a long generation would otherwise repeat at every layer and step: each topic is logged once per
process (:func:`warn_once`)."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("hf_sparse")

#: Topics already warned about in this process.
WARNED: set[str] = set()


def warn_once(topic: str, message: str, *args: Any) -> None:
    """Log ``message`` as a warning the first time ``topic`` comes up in this process."""
    if topic not in WARNED:
        WARNED.add(topic)
        logger.warning(message, *args)
