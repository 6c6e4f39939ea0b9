"""Result records: attribute access, and dict behaviour matching the seed's result dicts."""

from __future__ import annotations

from collections.abc import Mapping


class Record(Mapping):
    """An immutable result record.

    ``dict(record)`` gives exactly the record's keys, ``record["key"]`` and ``record.key`` both
    work, and a record compares equal to a dict with the same items, so results print and
    compare like the plain dicts the seed documents show.
    """

    __slots__ = ("_d",)
    _keys: tuple = ()

    def __init__(self, **items):
        if self._keys and tuple(items) != self._keys:
            missing = set(self._keys) ^ set(items)
            raise TypeError(f"{type(self).__name__} fields mismatch: {sorted(missing)}")
        object.__setattr__(self, "_d", dict(items))

    def __getitem__(self, key):
        return self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)

    def __getattr__(self, name):
        try:
            return object.__getattribute__(self, "_d")[name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no field {name!r}") from None

    def __setattr__(self, name, value):
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __eq__(self, other):
        if isinstance(other, Mapping):
            return self._d == dict(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self):
        return repr(self._d)

    def __reduce__(self):
        return (_rebuild, (type(self), self._d))


def _rebuild(cls, d):
    r = cls.__new__(cls)
    object.__setattr__(r, "_d", dict(d))
    return r


def record_type(name: str, keys: tuple, doc: str) -> type:
    """A Record subclass with a fixed, ordered set of keys."""
    return type(name, (Record,), {"__slots__": (), "_keys": tuple(keys), "__doc__": doc})
