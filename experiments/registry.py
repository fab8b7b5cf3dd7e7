"""A registry of named builders with facts: datasets, models, algorithms.

An entry names its builder by where it lives, ``"module:attribute"``, and
imports it the first time it builds. Reading the names and facts of the
entries (to parse flags, print ``--help``, resolve a run's defaults)
imports none of the builders' dependencies, such as JAX.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar


class UnknownNameError(KeyError, ValueError):
  """A name that no entry of a registry has."""

  def __str__(self) -> str:
    # KeyError would quote the message.
    return str(self.args[0])


@dataclasses.dataclass(frozen=True, kw_only=True)
class Entry:
  """One registered name and how to build what it names.

  Attributes:
    name: the name it is registered under.
    builder: the builder, or where to import it from as
      ``"module:attribute"``.
    options: keyword arguments bound to the builder, so that variants
      register one builder with different options.
  """

  name: str
  builder: Callable[..., Any] | str
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def build(self, *args: Any, **kwargs: Any) -> Any:
    """Calls the builder with ``args``, the bound options and ``kwargs``."""
    builder = self.builder
    if isinstance(builder, str):
      module, attribute = builder.split(":")
      builder = getattr(importlib.import_module(module), attribute)
    return builder(*args, **self.options, **kwargs)


E = TypeVar("E", bound=Entry)


class Registry(dict[str, E], Generic[E]):
  """Names to entries of one kind, in registration order.

  Indexing with an unknown name raises `UnknownNameError` listing the known
  names; ``in`` and ``get`` work as on any dict.
  """

  def __init__(self, kind: str, entry_type: type[E]):
    """Makes an empty registry.

    Args:
      kind: what the entries are, for messages, e.g. ``"dataset"``.
      entry_type: the `Entry` subclass whose fields are the entries' facts.
    """
    super().__init__()
    self.kind = kind
    self.entry_type = entry_type

  def register(
      self, name: str, builder: Callable[..., Any] | str, **facts: Any
  ) -> E:
    """Adds the entry ``entry_type(name=name, builder=builder, **facts)``.

    Returns:
      The entry.

    Raises:
      ValueError: ``name`` is already registered.
    """
    if name in self:
      raise ValueError(f"{self.kind.capitalize()} {name!r} is already "
                       "registered.")
    self[name] = self.entry_type(name=name, builder=builder, **facts)
    return self[name]

  def in_order(self, names: Iterable[str]) -> list[str]:
    """The distinct ``names`` in registration order, unregistered ones last.

    Reports list algorithms and datasets in this order, so that tables and
    plot legends agree whatever order the records came in. Unregistered
    names (runs of an algorithm since removed) follow alphabetically.
    """
    names = set(names)
    known = [name for name in self if name in names]
    return known + sorted(names - set(known))

  def __missing__(self, name: str) -> E:
    raise UnknownNameError(f"Unknown {self.kind} {name!r}; known: "
                           f"{', '.join(self)}.")
