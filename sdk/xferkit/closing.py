"""Objects with an idempotent ``close()`` are context managers the same way."""

from __future__ import annotations

from typing import Self


class Closing:
    """``with obj:`` closes ``obj`` on the way out, whatever happened inside."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
