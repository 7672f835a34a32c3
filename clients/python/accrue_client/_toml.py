"""A job spec given as a dict, written as TOML text for SubmitJob.

The coordinator parses and checks the text exactly as it does a job file,
so this writer only has to be faithful: tables, arrays of scalars, strings,
integers, floats and booleans (what a job spec holds).
"""

import json
import math


def _scalar(v, where):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        # A JSON string is a valid TOML basic string (same escapes).
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x, where) for x in v) + "]"
    raise TypeError(
        f"{where}: {type(v).__name__} is not a job spec value "
        "(allowed: str, int, float, bool, a list of those, a dict for a table)"
    )


def _key(k):
    if not isinstance(k, str):
        raise TypeError(f"job spec keys are strings, not {type(k).__name__} ({k!r})")
    bare = k and all(c.isalnum() or c in "_-" for c in k) and k.isascii()
    return k if bare else json.dumps(k)


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
            lines.append(f"{_key(k)} = {_scalar(v, _prefix + k)}")
    for k, v in tables:
        name = _prefix + _key(k)
        lines.append("")
        lines.append(f"[{name}]")
        body = dumps(v, name + ".")
        if body:
            lines.append(body)
    return "\n".join(lines).strip("\n") + ("\n" if not _prefix else "")
