"""Python client of the accrue coordinator's JobService (gRPC).

    from accrue_client import Client
    c = Client.from_env()              # ACCRUE_COORDINATOR, ACCRUE_CA, ACCRUE_TOKEN_FILE
    job = c.submit("job.toml")         # or a dict of the same tables
    for ev in c.watch(job):            # step, eval and state events, to the end
        print(ev)
    c.series(job)                      # a pandas DataFrame (list of dicts without pandas)

Errors from the coordinator are raised as `AccrueError` carrying its status
code name and message (e.g. INVALID_ARGUMENT naming the field, the value
and the allowed range).
"""

from ._client import AccrueError, Client
from ._toml import dumps as toml_dumps

__all__ = ["AccrueError", "Client", "toml_dumps"]
