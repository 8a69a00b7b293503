"""A small name -> object registry shared by methods, models, datasets, partitioners, evaluation
protocols and post-run analyses, and the one rule by which they are found: a module registers what
it defines when it is imported, and its package imports every module it holds
(:func:`import_package_modules`), so adding a file is all it takes to add one."""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")


class UnknownNameError(KeyError):
    """Raised when a name is not registered; the message lists the allowed names."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


class Registry(Generic[T]):
    """Maps names to objects (functions or classes), with a readable error for unknown names."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return decorator

    def get(self, name: str) -> T:
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; allowed: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())


def import_package_modules(package: str, path: Iterable[str]) -> None:
    """Import every module and subpackage of ``package`` (its ``__name__`` and ``__path__``) except
    those named ``_*`` (plumbing such as ``algorithms/_lib``), so each registers its entries."""
    for module in pkgutil.iter_modules(path):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")
