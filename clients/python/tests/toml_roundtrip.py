"""The client's dict-to-TOML writer (accrue_client/_toml.py) against
TOML's own parser (tomllib): every dict of job spec values it writes parses
back equal to the dict, whatever the strings hold (characters outside the
Basic Multilingual Plane, control characters, quotes, backslashes), and
what TOML cannot carry is refused with one clear error.

Run as `python toml_roundtrip.py` (the Rust test
`the_python_clients_toml_round_trips` in tests/local_lifecycle.rs does);
it loads the writer from this checkout's sources, not an installed copy,
and prints "ok" last.
"""

import importlib.util
import math
import os
import random
import sys
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "accrue_toml", os.path.join(HERE, "..", "accrue_client", "_toml.py")
)
toml = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(toml)


def round_trip(d):
    text = toml.dumps(d)
    try:
        back = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise AssertionError(f"invalid TOML for {d!r}: {e}\n{text}") from e
    assert back == d, f"{d!r}\nwrote\n{text}\nread back {back!r}"


ODD = [
    "/tmp/😀/d",  # U+1F600, outside the BMP (json writes a surrogate pair)
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010FFFF \U00010000",
    "quote \" and backslash \\ and \\u0041 literally",
    "'single' '''triple''' \"\"\"triple\"\"\"",
    "".join(chr(c) for c in range(0x20)) + "\x7f",  # every control character
    "tab\tnewline\nreturn\rform\fback\b",
    "é ñ ß 中文 العربية \u200b \ufeff \ufffd",
    "",
    "# not a comment = [not] {a table}",
]


def main():
    # Strings as values, keys and table names.
    for s in ODD:
        round_trip({"s": s})
        round_trip({s: 1})
        round_trip({s: {s: s, "inner": {s: [s, s]}}})
    # Nested tables, arrays (nested, of tables), every scalar type.
    spec = {
        "name": "job-😀",
        "workers": 3,
        "lr": 0.1,
        "big": 2**63 - 1,
        "small": -(2**63),
        "tiny": 5e-324,
        "huge": 1.7976931348623157e308,
        "exp": 1e16,
        "neg_zero": -0.0,
        "inf": math.inf,
        "ninf": -math.inf,
        "on": True,
        "off": False,
        "empty_list": [],
        "ints": [1, 2, 3],
        "mixed": [1, "two", 3.0, False, [4, ["five"]]],
        "inline": [{"a": 1, "b": {"c": "😀"}}, {}],
        "model": {
            "kind": "mlp",
            "hidden": [64, 32],
            "deeper": {"still": {"deeper": {"x": "\x00\x1f\x7f"}}},
            "empty": {},
        },
        "data": {"path": "/tmp/😀/d", "with.dot": {"and space": "ok"}},
    }
    round_trip(spec)
    # Random strings over the whole of Unicode (no surrogates).
    rng = random.Random(56)
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF]
    for _ in range(300):
        s = "".join(chr(rng.choice(points)) for _ in range(rng.randint(0, 12)))
        ascii_tricky = "".join(rng.choice('"\\\x00\x7f\n\t\'#=[]{}') for _ in range(4))
        round_trip({"v": s + ascii_tricky, s: [s], "t": {s: {ascii_tricky: s}}})
    # NaN parses back as NaN (not equal to itself).
    assert math.isnan(tomllib.loads(toml.dumps({"x": math.nan}))["x"])
    # None leaves a key out (a job spec's default).
    assert tomllib.loads(toml.dumps({"a": None, "t": {"b": None, "c": 1}})) == {"t": {"c": 1}}
    # A float or int subclass is written as its number, not its repr.
    class F(float):
        def __repr__(self):
            return "F(?)"

    assert tomllib.loads(toml.dumps({"f": F(0.5)})) == {"f": 0.5}
    # What TOML cannot carry: one error naming the key and what is allowed.
    for bad, kind, words in [
        ({"s": "a\udc80b"}, ValueError, ["s:", "U+DC80", "allowed"]),
        ({"t": {"n": 2**63}}, ValueError, ["t.n:", "allowed"]),
        ({"t": {"x": object()}}, TypeError, ["t.x:", "allowed"]),
        ({"l": [None]}, TypeError, ["l[0]:", "allowed"]),
        ({1: 2}, TypeError, ["keys are strings"]),
    ]:
        try:
            toml.dumps(bad)
        except kind as e:
            assert all(w in str(e) for w in words), f"{bad!r}: {e}"
        else:
            raise AssertionError(f"{bad!r} was written")
    print("ok")


if __name__ == "__main__":
    sys.exit(main())
