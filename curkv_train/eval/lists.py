"""Comma-separated list types for command-line options (``--ratios 0.3,0.5``), registered with jsonargparse."""

from __future__ import annotations

from jsonargparse.typing import register_type


class FloatList(list):
    """Comma-separated numbers, e.g. ``0.3,0.5,0.7``."""


class IntList(list):
    """Comma-separated integers, e.g. ``512,1024``."""


class NameList(list):
    """Comma-separated names, e.g. ``ppl_text,passkey``."""


def _items(value) -> list:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    return [item.strip() if isinstance(item, str) else item for item in items if str(item).strip()]


register_type(FloatList, serializer=lambda v: ",".join(map(str, v)), deserializer=lambda v: FloatList(map(float, _items(v))))
register_type(IntList, serializer=lambda v: ",".join(map(str, v)), deserializer=lambda v: IntList(map(int, _items(v))))
register_type(NameList, serializer=lambda v: ",".join(v), deserializer=lambda v: NameList(map(str, _items(v))))
