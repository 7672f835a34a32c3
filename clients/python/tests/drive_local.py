"""Drives a running `accrue local` with accrue_client, as a user would from
a second shell that sourced the run's `<state-dir>/env`.

    python drive_local.py JOB_ID SPEC_PATH

JOB_ID: the run's job (running, far from its end); SPEC_PATH: its job
file. Run by tests/local_lifecycle.rs against a real coordinator (TLS and
tokens) and real workers; prints one JSON line of what it measured and
"ok" at the end, and fails (exit 1, a traceback) on the first broken
expectation.
"""

import json
import math
import os
import sys
import tomllib

from accrue_client import AccrueError, Client


def expect_error(code, fn, *args, contains=""):
    try:
        fn(*args)
    except AccrueError as e:
        assert e.code == code, f"{fn.__name__}{args}: {e.code} {e.message}"
        assert contains in e.message, f"{contains!r} not in {e.message!r}"
        return e
    raise AssertionError(f"{fn.__name__}{args} did not fail with {code}")


def main():
    job, spec_path = sys.argv[1], sys.argv[2]
    c = Client.from_env()

    jobs = c.list()
    assert any(j["id"] == job and j["state"] == "running" for j in jobs), jobs
    j = c.get(job)
    assert j["unit"] == "samples" and j["spec"]["name"] == job.rsplit("-", 1)[0], j
    assert j["counters"]["tokens_per_sec"] is None, "not a language model"

    # watch: the snapshot first, then steps (and evaluations) as they come.
    events = []
    for ev in c.watch(job):
        events.append(ev)
        kinds = [e["event"] for e in events]
        if kinds.count("step") >= 4 and "eval" in kinds:
            break
    assert events[0]["event"] == "snapshot" and events[0]["job"]["id"] == job, events[0]
    steps = [e for e in events if e["event"] == "step"]
    assert all(b["step"] > a["step"] for a, b in zip(steps, steps[1:])), steps
    evals = [e for e in events if e["event"] == "eval"]
    assert evals and 0.0 <= evals[0]["accuracy"] <= 1.0, evals

    # series: a DataFrame of points holding the steps the watch saw (a
    # point merges consecutive steps once the job has many: its loss_min
    # and loss_max hold each step's loss, a one-step point is the step).
    df = c.series(job)
    import pandas

    assert isinstance(df, pandas.DataFrame), type(df)
    points = list(df.itertuples())
    for s in steps:
        check_point(points, s)
    assert {"samples_per_sec", "samples_seen", "loss_min", "clip_coef"} <= set(df.columns)
    # The newest watched evaluation (a long job's oldest evaluations are
    # thinned once it has more than 1,024).
    ev_rows = c.evals(job)
    last_eval = evals[-1]
    assert last_eval["step"] in set(ev_rows["step"]), ev_rows
    row = ev_rows[ev_rows["step"] == last_eval["step"]].iloc[0]
    assert row["loss"] == last_eval["loss"] and row["accuracy"] == last_eval["accuracy"], row

    # Without pandas: a list of dicts with the same numbers.
    saved = sys.modules.get("pandas")
    sys.modules["pandas"] = None  # import pandas now raises ImportError
    try:
        rows = c.series(job, from_step=steps[1]["step"])
    finally:
        sys.modules["pandas"] = saved
    assert isinstance(rows, list) and rows[0]["step"] >= steps[1]["step"], rows[:2]
    for s in steps[1:]:
        check_point([Row(r) for r in rows], s)

    # submit: a dict (written as TOML, checked as a file is) and a path.
    with open(spec_path, "rb") as f:
        spec = tomllib.load(f)
    spec["name"] = "from-python"
    other = c.submit(spec)
    got = c.get(other)
    assert got["state"] == "pending", got  # the run's workers are busy
    assert got["spec"]["optimizer"]["lr"] == spec["optimizer"]["lr"], got["spec"]
    again = c.submit(spec_path)
    assert again != job and c.get(again)["spec"]["name"] == spec_path_name(spec_path)
    bad = dict(spec, optimizer=dict(spec["optimizer"], lr=-1.0))
    e = expect_error("INVALID_ARGUMENT", c.submit, bad, contains="optimizer.lr = -1")
    assert "must be" in e.message, e.message
    expect_error("INVALID_ARGUMENT", c.submit, {"name": "x"}, contains="model")
    assert not any(j["spec"]["name"] == "x" for j in c.list()), "a refused spec created a job"

    # cancel and resume.
    assert c.cancel(other)["state"] == "cancelled"
    assert c.resume(other)["state"] == "pending"
    assert c.cancel(other)["state"] == "cancelled"
    c.cancel(again)
    expect_error("NOT_FOUND", c.get, "no-such-job-1")
    expect_error("FAILED_PRECONDITION", c.cancel, other)

    # Tokens are checked: no token, then a token the coordinator does not know.
    env = dict(os.environ)
    anon = Client(env["ACCRUE_COORDINATOR"], ca=env["ACCRUE_CA"])
    expect_error("UNAUTHENTICATED", anon.list)
    wrong = Client(env["ACCRUE_COORDINATOR"], ca=env["ACCRUE_CA"], token="not-a-known-token")
    expect_error("UNAUTHENTICATED", wrong.get, job)

    # The run's job to its end: the watch ends with the state event.
    c.cancel(job)
    last = list(c.watch(job))[-1]
    assert last["event"] in ("state", "snapshot"), last
    final = last["to"] if last["event"] == "state" else last["job"]["state"]
    assert final == "cancelled", last
    print(json.dumps({"steps_seen": len(steps), "points": len(df), "first_loss": steps[0]["loss"]}))
    assert math.isfinite(steps[0]["loss"])
    print("ok")


class Row:
    """A dict row read as the DataFrame's rows are (attributes)."""

    def __init__(self, d):
        self.__dict__.update(d)


def check_point(points, s):
    """The point holding watched step `s` agrees with it."""
    (p,) = [p for p in points if p.first_step <= s["step"] <= p.step]
    assert p.loss_min <= s["loss"] <= p.loss_max, (p, s)
    if p.steps == 1:
        assert p.loss == s["loss"] and p.grad_norm == s["grad_norm"] and p.lr == s["lr"], (p, s)


def spec_path_name(path):
    with open(path, "rb") as f:
        return tomllib.load(f)["name"]


if __name__ == "__main__":
    main()
