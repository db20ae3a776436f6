"""A short most-recent-first list: what the weight-sync caches keep per bucket or per name (the
last weight sets a trainer pushed, e.g. two it alternates between)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Recent(Generic[T]):
    """At most ``size`` entries, most recent first; one found again moves to the front."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: list[T] = []

    def find(self, match: Callable[[T], bool]) -> T | None:
        for i, item in enumerate(self.items):
            if match(item):
                if i:
                    self.items.insert(0, self.items.pop(i))
                return item
        return None

    def add(self, item: T) -> T:
        self.items.insert(0, item)
        del self.items[self.size :]
        return item
