"""What every RL framework drop-in shares: the framework version it was
written against (:class:`Pinned`), and the classes it derives from the
framework's own, built on first use (:class:`LazyClasses`).

A drop-in reads, patches or subclasses a framework's private hooks, which
move between versions; so each one names the version it read and refuses
another with that name and the command that installs it, before it touches
anything. Its subclasses cannot be defined at import (``import
reshard.integrations.<framework>`` works without the framework): they are
built when first asked for, once, after the version check, and carry the
drop-in's module and their own name (so that Ray, verl's
``load_class_from_fqn`` and pickling find them by that name).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["LazyClasses", "Pinned"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Pinned:
    """The framework version a drop-in was written against."""

    module: str
    """The drop-in (``reshard.integrations.trl``), as errors name it."""
    framework: str
    """The framework as users name it (``TRL``)."""
    distribution: str
    """Its distribution on PyPI (``trl``), whose installed metadata is read."""
    version: str
    read: str
    """What the drop-in read in that version (its hooks, the names it patches)."""
    no_deps: bool = True
    """Install it with ``--no-deps`` (its own pins would move torch or vLLM)."""

    @property
    def install(self) -> str:
        """The command that installs the pinned version."""
        return f"pip install {'--no-deps ' if self.no_deps else ''}{self.distribution}=={self.version}"

    def check(self) -> str:
        """The installed version (read from the distribution's metadata,
        without importing the framework); an ``ImportError`` naming the
        pinned one and how to install it when it is missing or another."""
        from importlib import metadata

        try:
            found = metadata.version(self.distribution)
        except metadata.PackageNotFoundError as e:
            raise ImportError(f"{self.module} needs {self.framework} {self.version}: {self.install}") from e
        if found != self.version:
            raise ImportError(
                f"{self.module} was written against {self.framework} {self.version} ({self.read}) but "
                f"{self.framework} {found} is installed: {self.install}"
            )
        return found


class LazyClasses:
    """A drop-in's classes built from the framework's on first use: each
    builder (:meth:`builds`) runs once, after ``pin``'s check, and its class
    is kept; :meth:`getattr` is the module's ``__getattr__``."""

    def __init__(self, module: str, pin: Pinned) -> None:
        self.module = module
        self.pin = pin
        self._builders: dict[str, Callable[[], type]] = {}
        self._built: dict[str, type] = {}

    def builds(self, name: str) -> Callable[[Callable[[], type]], Callable[[], type]]:
        """Decorate the function that builds class ``name``; calling it
        returns the one class built."""

        def register(build: Callable[[], type]) -> Callable[[], type]:
            @functools.wraps(build)
            def get() -> type:
                cls = self._built.get(name)
                if cls is None:
                    self.pin.check()
                    cls = build()
                    cls.__module__ = self.module
                    cls.__name__ = cls.__qualname__ = name
                    self._built[name] = cls
                return cls

            self._builders[name] = get
            return get

        return register

    def getattr(self, name: str) -> Any:
        """A module ``__getattr__``: the class ``name``, built on first access."""
        get = self._builders.get(name)
        if get is None:
            raise AttributeError(f"module {self.module!r} has no attribute {name!r}")
        return get()
