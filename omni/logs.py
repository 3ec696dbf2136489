"""One log format for every OMNI process, tagged with the component that wrote it."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(component: str) -> None:
    level = os.environ.get("OMNI_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {component} %(levelname)s %(name)s: %(message)s")
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
