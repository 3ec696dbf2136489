"""What a model's spec says alike in a node's config, the admin API, and the models file
the scheduler places from: sizes (`parse_size`) and the keys that say what runs a
handler's model (`HANDLER_KEYS`). A leaf: the scheduler imports it without the node's
catalog (omni/runtime/catalog.py, which exports both too).
"""

from __future__ import annotations

import re

SIZE_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(value) -> int:
    """Bytes from an integer or a string such as '4GiB' or '512M'."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and (m := SIZE_RE.match(value)):
        unit = SIZE_UNITS.get(m.group(2).lower())
        if unit is not None and float(m.group(1)) > 0:
            return int(float(m.group(1)) * unit)
    raise ValueError(f"{value!r} is not a size (e.g. 4GiB, 512MiB or a byte count)")


HANDLER_KEYS = ("handler", "requirements", "max_batch_size", "max_queue_delay_ms", "infer_timeout")
HANDLER_KEYS += ("gpu_split",)
