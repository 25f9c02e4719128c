"""Measurement-only stand-in for pydantic.BaseModel: annotated defaults, keyword overrides (cast), .dict()."""

import typing


class BaseModel:
    def __init__(self, **kwargs):
        hints = typing.get_type_hints(type(self))
        for name in hints:
            if hasattr(type(self), name):
                setattr(self, name, getattr(type(self), name))
        for name, value in kwargs.items():
            if name not in hints:
                raise TypeError(f"unknown field {name}")
            kind = hints[name]
            setattr(self, name, kind(value) if kind in (int, float, bool) else value)

    def dict(self):
        return {name: getattr(self, name) for name in typing.get_type_hints(type(self))}

    def __repr__(self):
        return f"{type(self).__name__}({self.dict()})"
