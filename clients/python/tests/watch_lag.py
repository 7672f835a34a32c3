"""Reads a running job's watch slowly, as a busy notebook would: the
watch falls behind, gets a fresh snapshot and goes on.

    python watch_lag.py JOB_ID

JOB_ID: a running job far from its end, on a coordinator that keeps few
events for its watchers (ACCRUE_WATCH_BUFFER). Run by tests/watch_lag.rs
from the environment of the run's env file; prints one JSON line of what
it saw and "ok" at the end, and fails (exit 1, a traceback) otherwise.
"""

import json
import sys
import time

from accrue_client import Client


def step_of(c, job):
    return c.get(job)["counters"]["step"]


def wait_for_step(c, job, target, limit=120.0):
    """Polls the job (not the watch) until it has committed `target`."""
    deadline = time.monotonic() + limit
    while step_of(c, job) < target:
        assert time.monotonic() < deadline, f"the job did not reach step {target}"
        time.sleep(0.05)


def main():
    job = sys.argv[1]
    c = Client.from_env()
    events = c.watch(job)
    first = next(events)
    assert first["event"] == "snapshot" and first["job"]["id"] == job, first
    last = None
    for ev in events:
        if ev["event"] == "step":
            last = ev["step"]
            break
    assert last is not None
    # Each round: stop reading until the job is `behind` steps past the
    # last step read, then read on until a fresh snapshot comes (it fell
    # behind) or the watch has caught up with where the job was (it did
    # not fall far enough behind: wait longer next round).
    behind = 1000
    for _ in range(10):
        wait_for_step(c, job, last + behind)
        now = step_of(c, job)
        for ev in events:
            if ev["event"] == "snapshot":
                snap = ev["job"]["counters"]["step"]
                assert ev["job"]["id"] == job and snap > last, (snap, last)
                assert ev["job"]["spec"]["name"] == job.rsplit("-", 1)[0], ev["job"]
                # And it goes on: the steps after the snapshot.
                after = []
                for more in events:
                    if more["event"] == "step":
                        after.append(more["step"])
                        if len(after) == 3:
                            break
                assert after == sorted(after) and after[0] > last, (after, last)
                print(json.dumps({"last_read": last, "snapshot": snap, "after": after}))
                print("ok")
                return
            if ev["event"] == "step":
                assert ev["step"] > last, (ev["step"], last)
                last = ev["step"]
                if last >= now:
                    break
        behind *= 2
    raise AssertionError(f"the watch never fell behind (last read step {last})")


if __name__ == "__main__":
    main()
