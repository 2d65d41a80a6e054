"""The library's logger: `logging.getLogger("etdist")`, each module's a child of it
(`etdist.fusion.compile`). Silent unless the application configures logging (a NullHandler), or
ETDIST_DEBUG=1 (each compiler pass and each generated GPU kernel) asks to see records."""
from __future__ import annotations

import logging

LOGGER = logging.getLogger("etdist")
LOGGER.addHandler(logging.NullHandler())
_FORMAT = "[%(name)s] %(message)s"


def _has_output(logger: logging.Logger) -> bool:
    """Whether a record of `logger` reaches a handler other than a NullHandler."""
    while logger is not None:
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return True
        logger = logger.parent if logger.propagate else None
    return False


def show_debug(logger: logging.Logger) -> None:
    """Let `logger` (an etdist logger) emit its debug records, to stderr unless the application
    already sends etdist's records somewhere."""
    logger.setLevel(logging.DEBUG)
    if not _has_output(logger):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        LOGGER.addHandler(handler)
