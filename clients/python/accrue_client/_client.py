"""The JobService client: connection, calls, and their answers as dicts."""

import os

import grpc
import re

from ._toml import dumps as _toml_dumps
from .v1 import accrue_pb2 as pb
from .v1 import accrue_pb2_grpc as pb_grpc

#: The environment variables `Client.from_env` reads (`accrue local` writes
#: them to `<state-dir>/env`; the `accrue` CLI reads the same).
ENV = ("ACCRUE_COORDINATOR", "ACCRUE_CA", "ACCRUE_TOKEN_FILE", "ACCRUE_INSECURE")

FINAL_STATES = ("succeeded", "failed", "cancelled")


class AccrueError(Exception):
    """A call the coordinator refused or could not answer: `code` is the
    gRPC status name (e.g. "INVALID_ARGUMENT", "NOT_FOUND",
    "PERMISSION_DENIED", "UNAVAILABLE"), `message` the coordinator's words."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _raise(e):
    code = e.code().name if hasattr(e, "code") and e.code() else "UNKNOWN"
    details = e.details() if hasattr(e, "details") else str(e)
    raise AccrueError(code, details or "") from None


def _truthy(v):
    return v is not None and v.strip().lower() in ("1", "true", "yes", "on")


def _target(coordinator, tls):
    """(grpc target, tls) from HOST:PORT or a URL whose scheme agrees."""
    if "://" in coordinator:
        scheme, rest = coordinator.split("://", 1)
        if scheme not in ("http", "https"):
            raise ValueError(f"coordinator {coordinator!r}: the scheme must be http or https")
        if (scheme == "https") != tls:
            raise ValueError(
                f"coordinator {coordinator!r}: {scheme}:// "
                + ("needs a CA (ca=...)" if scheme == "https" else "contradicts ca=...")
            )
        coordinator = rest.rstrip("/")
    return coordinator


def _enum_prefix(enum_type):
    """JobState -> "JOB_STATE_": the prefix every value name carries."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum_type.name).upper() + "_"


def _enum_name(enum_type, number):
    """An enum value by its short name: JOB_STATE_RUNNING -> "running"."""
    v = enum_type.values_by_number.get(number)
    if v is None:
        return number
    name = v.name
    prefix = _enum_prefix(enum_type)
    return (name[len(prefix):] if name.startswith(prefix) else name).lower()


def _repeated(f):
    r = getattr(f, "is_repeated", None)
    return r if r is not None else f.label == f.LABEL_REPEATED


def _dict(msg):
    """A message as a dict: every field by its proto name (defaults
    included), enums by short name ("running", "llama"), absent messages
    and unset optional numbers as None."""
    out = {}
    for f in msg.DESCRIPTOR.fields:
        v = getattr(msg, f.name)
        if _repeated(f):
            if f.message_type is not None:
                out[f.name] = [_dict(x) for x in v]
            elif f.enum_type is not None:
                out[f.name] = [_enum_name(f.enum_type, x) for x in v]
            else:
                out[f.name] = list(v)
        elif f.message_type is not None or f.has_presence:
            if not msg.HasField(f.name):
                out[f.name] = None
            elif f.message_type is not None:
                out[f.name] = _dict(v)
            else:
                out[f.name] = v
        elif f.enum_type is not None:
            out[f.name] = _enum_name(f.enum_type, v)
        else:
            out[f.name] = v
    return out


def _state(number):
    return _enum_name(pb.JobState.DESCRIPTOR, number)


def _job(msg):
    """A Job as a dict (see `_dict`): `state` is "pending", "running", ..."""
    return _dict(msg)


class _Bearer(grpc.AuthMetadataPlugin):
    def __init__(self, token):
        self._md = (("authorization", f"Bearer {token}"),)

    def __call__(self, context, callback):
        callback(self._md, None)


class Client:
    """A client of the coordinator at `coordinator` (HOST:PORT, or an
    https:// or http:// URL).

    `ca`: the cluster CA's PEM file (TLS; `accrue local` makes one per
    run); without it the connection is plaintext, which needs
    `insecure=True`, as the CLI's `--insecure`. `token_file` (or `token`):
    the bearer token sent with every call; its scopes decide what is
    allowed. `timeout`: seconds for each unary call.
    """

    def __init__(self, coordinator, token_file=None, ca=None, *, token=None, insecure=False, timeout=30.0):
        if token is not None and token_file is not None:
            raise ValueError("both token and token_file are given; give one")
        if ca is not None and insecure:
            raise ValueError("ca and insecure=True contradict each other: TLS or plaintext?")
        if ca is None and not insecure:
            raise ValueError(
                "no CA: give ca= (the cluster CA's PEM, TLS) or insecure=True (plaintext); "
                "Client.from_env() reads ACCRUE_CA and ACCRUE_INSECURE"
            )
        if token_file is not None:
            with open(token_file) as f:
                token = f.read().strip()
        if token is not None and (not token or not all(33 <= ord(c) < 127 for c in token)):
            raise ValueError("the token must be non-empty visible ASCII without spaces")
        target = _target(coordinator, ca is not None)
        self.coordinator = coordinator
        self.timeout = timeout
        if ca is not None:
            with open(ca, "rb") as f:
                creds = grpc.ssl_channel_credentials(root_certificates=f.read())
            if token is not None:
                creds = grpc.composite_channel_credentials(
                    creds, grpc.metadata_call_credentials(_Bearer(token))
                )
            self._channel = grpc.secure_channel(target, creds)
            self._metadata = None
        else:
            self._channel = grpc.insecure_channel(target)
            # Call credentials need TLS in gRPC; in plaintext the header
            # goes as plain metadata (the coordinator reads the same).
            self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._stub = pb_grpc.JobServiceStub(self._channel)

    @classmethod
    def from_env(cls, **kw):
        """A client from ACCRUE_COORDINATOR (default 127.0.0.1:50051),
        ACCRUE_CA, ACCRUE_TOKEN_FILE and ACCRUE_INSECURE, as the CLI reads
        them; keyword arguments win."""
        env = os.environ
        args = {
            "coordinator": env.get("ACCRUE_COORDINATOR") or "127.0.0.1:50051",
            "ca": env.get("ACCRUE_CA") or None,
            "token_file": env.get("ACCRUE_TOKEN_FILE") or None,
            "insecure": _truthy(env.get("ACCRUE_INSECURE")),
        }
        args.update(kw)
        coordinator = args.pop("coordinator")
        return cls(coordinator, **args)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            _raise(e)

    def submit(self, spec):
        """Submits a job: `spec` is a job file's path (its TOML text is
        sent and checked there as `accrue submit` checks the file) or a
        dict of the same keys and tables. Returns the job's id."""
        if isinstance(spec, dict):
            text = _toml_dumps(spec)
        elif isinstance(spec, (str, os.PathLike)):
            with open(spec) as f:
                text = f.read()
        else:
            raise TypeError(f"submit takes a job file's path or a dict, not {type(spec).__name__}")
        job = self._call(self._stub.SubmitJob, pb.SubmitJobRequest(spec_toml=text))
        return job.id

    def get(self, job_id):
        """The job as a dict (`state` by name; a language model's counters
        carry `tokens_per_sec` and `tokens_seen`, its eval `perplexity`)."""
        return _job(self._call(self._stub.GetJob, pb.GetJobRequest(id=job_id)))

    def list(self):
        """Every job, in creation order (all pages)."""
        jobs, token = [], ""
        while True:
            page = self._call(self._stub.ListJobs, pb.ListJobsRequest(page_size=1000, page_token=token))
            jobs.extend(_job(j) for j in page.jobs)
            if not page.next_page_token:
                return jobs
            if page.next_page_token == token:
                raise AccrueError("INTERNAL", "the coordinator answered the same page token twice")
            token = page.next_page_token

    def cancel(self, job_id):
        """Cancels the job; returns it."""
        return _job(self._call(self._stub.CancelJob, pb.CancelJobRequest(id=job_id)))

    def resume(self, job_id):
        """Resumes a failed or cancelled job from its newest checkpoint;
        returns it."""
        return _job(self._call(self._stub.ResumeJob, pb.ResumeJobRequest(id=job_id)))

    def watch(self, job_id):
        """The job's events until it ends, as dicts: `{"event": "step",
        ...the step report}`, `{"event": "eval", ...}` and `{"event":
        "state", "from", "to", "reason"}`; the first is `{"event":
        "snapshot", "job": {...}}`. A watcher that reads more slowly than
        the job makes events and falls behind gets a fresh snapshot and
        goes on (the events it missed are not sent)."""
        while True:
            try:
                stream = self._stub.WatchJob(pb.WatchJobRequest(id=job_id), metadata=self._metadata)
                for ev in stream:
                    yield _event(ev)
                return
            except grpc.RpcError as e:
                # A coordinator from before fresh snapshots ends a watcher
                # that fell behind with DATA_LOSS: watch again.
                if e.code() != grpc.StatusCode.DATA_LOSS:
                    _raise(e)

    def series(self, job_id, from_step=0, max_points=0):
        """The job's training curve, one row per point (consecutive steps
        merged as the status page does: `loss` is their mean, with
        `loss_min` and `loss_max`): a pandas DataFrame when pandas is
        installed, else a list of dicts. A language model's throughput
        columns are named `tokens_per_sec` and `tokens_seen`.

        `evals(job_id)` gives the evaluations."""
        r = self._series(job_id, from_step, max_points)
        rows = [_point(p, r.unit) for p in r.points]
        return _frame(rows)

    def evals(self, job_id):
        """The job's evaluations (a language model's with `perplexity`), as
        `series` returns its rows."""
        r = self._series(job_id, 0, 0)
        rows = []
        for p in r.evals:
            row = _dict(p.eval)
            row["wall_unix_ms"] = p.wall_unix_ms
            rows.append(row)
        return _frame(rows)

    def _series(self, job_id, from_step, max_points):
        req = pb.GetSeriesRequest(id=job_id, from_step=from_step, max_points=max_points)
        return self._call(self._stub.GetSeries, req)


def _mean(total, n):
    return total / n if n else float("nan")


def _point(b, unit):
    rate = "tokens_per_sec" if unit == "tokens" else "samples_per_sec"
    seen = "tokens_seen" if unit == "tokens" else "samples_seen"
    return {
        "step": b.last_step,
        "first_step": b.first_step,
        "steps": b.count,
        "loss": _mean(b.loss_sum, b.finite),
        "loss_min": b.loss_min if b.finite else float("nan"),
        "loss_max": b.loss_max if b.finite else float("nan"),
        "grad_norm": _mean(b.grad_norm_sum, b.grad_finite),
        "grad_norm_max": b.grad_norm_max if b.grad_finite else float("nan"),
        "clip_coef": _mean(b.clip_coef_sum, b.grad_finite),
        "lr": b.lr,
        rate: _mean(b.samples_per_sec_sum, b.count),
        seen: b.samples_seen,
        "skipped": b.skipped,
        "wall_unix_ms": b.wall_unix_ms,
    }


def _frame(rows):
    try:
        import pandas
    except ImportError:
        return rows
    return pandas.DataFrame(rows)


def _event(ev):
    kind = ev.WhichOneof("event")
    if kind is None:
        return {"event": "snapshot", "job": _job(ev.job)}
    if kind == "step":
        d = _dict(ev.step)
        d.pop("resumed_from", None)
        out = {"event": "step", **d}
        if ev.job.unit == "tokens":
            out["tokens_per_sec"] = ev.step.samples_per_sec
            out["tokens"] = ev.step.samples
        return out
    if kind == "eval":
        return {"event": "eval", **_dict(ev.eval)}
    t = ev.transition
    return {
        "event": "state",
        "from": _state(getattr(t, "from")),
        "to": _state(t.to),
        "reason": t.reason,
        "job": _job(ev.job),
    }
