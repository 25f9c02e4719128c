"""Measurement-only stand-in for OmegaConf.from_cli / to_object (key=value arguments)."""

import sys


class OmegaConf:
    @staticmethod
    def from_cli():
        out = {}
        for arg in sys.argv[1:]:
            key, value = arg.split("=", 1)
            for cast in (int, float):
                try:
                    value = cast(value)
                    break
                except ValueError:
                    pass
            out[key] = value
        return out

    @staticmethod
    def to_object(conf):
        return dict(conf)
