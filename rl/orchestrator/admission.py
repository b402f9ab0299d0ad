"""Admission with a staleness bound: episodes start only while they can still be trained on.

The trainer consumes `batch_size` episodes per version. An episode started while the trainer
is at version v is used at a version >= v; it is at most S versions stale if no more than
`(v - v0 + S + 1) * batch_size` episodes have been started in total since version v0.
`S = 0` is synchronous: exactly one batch per version, and the next starts only after the
trainer moves on.
"""

from __future__ import annotations

import asyncio


class AdmissionController:
    """`await admit()` before starting an episode; the trainer calls `set_version(v)`."""

    def __init__(self, batch_size: int, max_staleness: int | None, version: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} is invalid: >= 1")
        self.batch_size, self.max_staleness = batch_size, max_staleness
        self.version = self.base_version = version
        self.started = 0
        self._changed = asyncio.Condition()

    def capacity(self) -> float:
        """Total episodes that may have started at the current version."""
        if self.max_staleness is None:
            return float("inf")
        return (self.version - self.base_version + self.max_staleness + 1) * self.batch_size

    async def admit(self, n: int = 1) -> int:
        """Wait for room for `n` episodes at once (a group that must start together: taken one
        by one, many groups' first episodes could fill a batch that none of them completes);
        returns the trainer version they start under."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.started + n <= self.capacity())
            self.started += n
            return self.version

    def rebase(self, version: int) -> None:
        """Start counting at `version` (a trainer resumed at step k serves version k + 1):
        only before any episode was admitted."""
        if self.started:
            raise RuntimeError(f"rebase after {self.started} admitted episodes")
        self.version = self.base_version = version

    async def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"trainer version went backwards: {version} < {self.version}")
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def release(self) -> None:
        """An admitted episode never ran (cancelled before starting): give its place back."""
        async with self._changed:
            self.started -= 1
            self._changed.notify_all()
