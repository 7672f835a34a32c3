"""A job spec given as a dict, written as TOML text for SubmitJob.

The coordinator parses and checks the text exactly as it does a job file,
so this writer only has to be faithful: tables, arrays, strings, integers,
floats and booleans (what a job spec holds); a dict inside an array is
written as an inline table. Any Unicode string round-trips: strings are
TOML basic strings with TOML's own escapes (not JSON's, whose surrogate
pairs for characters outside the Basic Multilingual Plane TOML refuses).
"""

import math

# TOML's short escapes; every other control character (U+0000 to U+001F
# and U+007F) is written as \\uXXXX.
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _string(s, where):
    out = ['"']
    for c in s:
        o = ord(c)
        if c in _SHORT:
            out.append(_SHORT[c])
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04X}")
        elif 0xD800 <= o <= 0xDFFF:
            # A lone surrogate (e.g. from surrogateescape) is no Unicode
            # scalar value: neither TOML nor UTF-8 can carry it.
            raise ValueError(
                f"{where}: {s!r} holds the lone surrogate U+{o:04X}, which is not "
                "text (allowed: any Unicode character except U+D800 to U+DFFF)"
            )
        else:
            out.append(c)
    out.append('"')
    return "".join(out)


def _value(v, where):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        if not -(2**63) <= v < 2**63:
            raise ValueError(
                f"{where}: {v} does not fit TOML's integers (allowed: -2^63 to 2^63 - 1)"
            )
        # int.__repr__, not str(): an int subclass (an IntEnum) may print a name.
        return int.__repr__(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        # float.__repr__: a float subclass (numpy's float64) prints its type.
        return float.__repr__(v)
    if isinstance(v, str):
        return _string(v, where)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, f"{where}[{i}]") for i, x in enumerate(v)) + "]"
    if isinstance(v, dict):
        items = [
            f"{_key(k)} = {_value(x, f'{where}.{k}')}" for k, x in v.items() if x is not None
        ]
        return "{" + ", ".join(items) + "}"
    raise TypeError(
        f"{where}: {type(v).__name__} is not a job spec value "
        "(allowed: str, int, float, bool, a list of those, a dict for a table)"
    )


def _key(k):
    if not isinstance(k, str):
        raise TypeError(f"job spec keys are strings, not {type(k).__name__} ({k!r})")
    bare = k and all(c.isalnum() or c in "_-" for c in k) and k.isascii()
    return k if bare else _string(k, "a key")


def dumps(spec, _prefix=""):
    """`spec` (a dict of keys and tables) as TOML text."""
    if not isinstance(spec, dict):
        raise TypeError(f"a job spec is a dict, not {type(spec).__name__}")
    lines = []
    tables = []
    for k, v in spec.items():
        if isinstance(v, dict):
            tables.append((k, v))
        elif v is not None:
            lines.append(f"{_key(k)} = {_value(v, _prefix + k)}")
    for k, v in tables:
        name = _prefix + _key(k)
        lines.append("")
        lines.append(f"[{name}]")
        body = dumps(v, name + ".")
        if body:
            lines.append(body)
    return "\n".join(lines).strip("\n") + ("\n" if not _prefix else "")
