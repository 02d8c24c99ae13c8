"""A module imported on first use rather than at collection: every xdist worker collects every test file, so a
heavy client library imported at a file's top costs each worker its import even where that file runs on
the other one."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        if self._module is None:
            self._module = importlib.import_module(self.__name__)
        return getattr(self._module, attr)
