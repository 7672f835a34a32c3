#!/usr/bin/env python3
"""Semantic checks of rendered accrue manifests (tests/deploy/ runs this).

    check_manifests.py --bin-dir DIR --etcd-flags FILE --expect cpu|gpu \
        [--namespace accrue] [--facts OUT.json] RENDERED.yaml [MORE.yaml ...]

Reads every document of the given files (the output of `kubectl kustomize`,
plus stand-alone manifests such as deploy/examples/submit-job.yaml) and
prints one line per problem found, `<kind>/<name>: <problem>`; exits 1 if
there is any, 0 otherwise. What it checks, for every workload (Deployment,
StatefulSet, Job, Pod) and the objects around it:

- selectors match the pod template's labels; Services, PDBs,
  NetworkPolicies, ServiceMonitors select pods (or Services) that exist;
  every named port (Service targetPort, probe, NetworkPolicy) exists on the
  selected containers, and listen flags agree with the declared ports;
- every Secret, ConfigMap (and key), ServiceAccount, PVC (or
  volumeClaimTemplate) referenced is defined; a file a flag names under a
  Secret or ConfigMap mount is a key of it (for every pod of a StatefulSet);
- probes are what the binaries serve: the coordinator's /healthz and
  /readyz on its --http port over HTTPS, the worker daemon's on its
  --health-listen port, etcd's /health (local for liveness, quorum for
  readiness) on its metrics port;
- `--expect gpu`: workers limit nvidia.com/gpu, tolerate its taint, run
  --device cuda:N on the CUDA image; `--expect cpu`: nothing asks for a GPU;
- PDBs never exceed the replicas; images are pinned (a tag that is not
  `latest`, or a digest); no Secret reaches a container as an environment
  variable, and no Secret's value appears in args or env;
- restricted security context, no service account token, requests and
  limits on every container;
- every container command is accepted by the real binary: the args, with
  $(VAR) expanded from the container's env (downward API and ConfigMap
  values filled in), are run through the accrue binaries in --bin-dir with
  `--help` appended (clap parses every flag and value before it and refuses
  an unknown one); etcd's flags are checked against --etcd-flags, the flag
  list of the pinned etcd version (no etcd 3.5 binary runs here) and, with
  --etcd-bin, through that etcd binary too (Debian's 3.4 on the test
  machines: the flags must suit both).

--facts writes what the Rust side checks with an X.509 parser: which
certificate (Secret, key, PEM) must name which host, and the job specs the
CLI containers submit.
"""

import argparse
import base64
import json
import math
import os
import re
import subprocess
import sys
from collections import defaultdict

import yaml

ACCRUE_BINARIES = ("accrue", "accrue-coordinator", "accrue-worker")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Job", "Pod", "DaemonSet", "ReplicaSet")
CLUSTER_SCOPED = ("Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume",
                  "StorageClass", "CustomResourceDefinition", "PriorityClass")
FIELD_PLACEHOLDERS = {
    "status.podIP": "10.0.0.10",
    "status.hostIP": "10.0.1.1",
    "spec.nodeName": "node-1",
    "metadata.uid": "00000000-0000-0000-0000-000000000000",
}
PART_OF = ("app.kubernetes.io/part-of", "accrue")
# What etcd's metrics listener serves that a probe may ask for, in both
# 3.4 (the test machines' etcd) and 3.5: member-local health for liveness
# (serializable: without quorum it still answers; 3.5.3 and later), quorum
# for readiness.
ETCD_ALIVE = {"/health?exclude=NOSPACE&serializable=true", "/health?serializable=true"}
ETCD_READY = {"/health", "/health?exclude=NOSPACE"}
# Labels for clients that live outside the rendered manifests (users' Jobs,
# the example): a NetworkPolicy may admit them though no pod here has them.
CLIENT_LABEL_PREFIX = "accrue.dev/"


class Problems:
    def __init__(self):
        self.items = []

    def add(self, where, msg):
        self.items.append(f"{where}: {msg}")


def kn(doc):
    return f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"


# ---------------------------------------------------------------- helpers

def parse_quantity(q):
    """A Kubernetes quantity as a float (cpu in cores, memory in bytes)."""
    s = str(q)
    suffixes = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
                "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "m": 1e-3}
    for suf, mul in sorted(suffixes.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suf):
            return float(s[: -len(suf)]) * mul
    return float(s)


def expand(text, env):
    """Kubernetes' $(VAR) expansion: `$$` is a literal `$`, $(VAR) of a
    defined VAR is replaced, anything else is left as it is. Returns the
    text and the names that could not be resolved."""
    out, unresolved, i = [], [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i + 2:]:
            end = text.index(")", i + 2)
            name = text[i + 2:end]
            if name in env:
                out.append(env[name])
            else:
                unresolved.append(name)
                out.append(text[i:end + 1])
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out), unresolved


def flag_values(args, flag):
    """Values of `flag` in args (`--flag=V` or `--flag V`)."""
    vals = []
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            vals.append(a[len(flag) + 1:])
        elif a == flag and i + 1 < len(args):
            vals.append(args[i + 1])
    return vals


def flag_value(args, flag):
    v = flag_values(args, flag)
    return v[-1] if v else None


def host_port(addr):
    """(host, port) of `HOST:PORT` or a URL `scheme://HOST:PORT/...`."""
    if "://" in addr:
        addr = addr.split("://", 1)[1]
    addr = addr.split("/", 1)[0]
    if ":" not in addr:
        return addr, None
    host, port = addr.rsplit(":", 1)
    try:
        return host, int(port)
    except ValueError:
        return host, None


def labels_match(selector_labels, labels):
    return all(labels.get(k) == v for k, v in (selector_labels or {}).items())


def selector_matches(selector, labels):
    """A LabelSelector (matchLabels + matchExpressions) against labels."""
    if selector is None:
        return False
    if not labels_match(selector.get("matchLabels"), labels):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def image_problem(image):
    if not image:
        return "has no image"
    if "@sha256:" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return f"image {image} is not pinned (no tag)"
    if last.rsplit(":", 1)[1] == "latest":
        return f"image {image} uses the tag latest"
    return None


# ---------------------------------------------------------------- model

class Pods:
    """The pods a workload makes: its template and the names they get."""

    def __init__(self, doc):
        self.doc = doc
        self.kind = doc["kind"]
        self.name = doc["metadata"]["name"]
        self.ns = doc["metadata"].get("namespace")
        spec = doc.get("spec", {})
        if self.kind == "Pod":
            self.template = {"metadata": doc.get("metadata", {}), "spec": spec}
            self.replicas = 1
        elif self.kind == "Job":
            self.template = spec.get("template", {})
            self.replicas = spec.get("parallelism", 1)
        else:
            self.template = spec.get("template", {})
            self.replicas = spec.get("replicas", 1)
        self.labels = self.template.get("metadata", {}).get("labels", {}) or {}
        self.spec = self.template.get("spec", {}) or {}
        if self.kind == "StatefulSet":
            self.pod_names = [f"{self.name}-{i}" for i in range(self.replicas)]
        elif self.kind == "Pod":
            self.pod_names = [self.name]
        else:
            # Generated names; one stands for all (they differ only in it).
            self.pod_names = [f"{self.name}-7c9d8f6b5-x2x4z"]

    def containers(self):
        return (self.spec.get("initContainers") or []) + (self.spec.get("containers") or [])

    def all_ports(self):
        return [p for c in self.spec.get("containers") or [] for p in c.get("ports") or []]


class Manifests:
    def __init__(self, docs, namespace):
        self.docs = docs
        self.namespace = namespace
        self.by_kind = defaultdict(dict)
        for d in docs:
            md = d.get("metadata", {})
            self.by_kind[d.get("kind")][(md.get("namespace"), md.get("name"))] = d
        self.workloads = [Pods(d) for d in docs if d.get("kind") in WORKLOAD_KINDS]

    def get(self, kind, ns, name):
        return self.by_kind.get(kind, {}).get((ns, name))

    def secret_data(self, ns, name):
        s = self.get("Secret", ns, name)
        if s is None:
            return None
        data = {k: base64.b64decode(v).decode("utf-8", "replace")
                for k, v in (s.get("data") or {}).items()}
        data.update(s.get("stringData") or {})
        return data

    def configmap_data(self, ns, name):
        c = self.get("ConfigMap", ns, name)
        if c is None:
            return None
        return dict(c.get("data") or {})

    def pods_selected(self, ns, selector_labels):
        return [w for w in self.workloads
                if w.ns == ns and selector_labels and labels_match(selector_labels, w.labels)]

    def service_for_host(self, ns, host):
        """The Service a DNS name reaches from a pod of `ns`."""
        for suffix in ("", f".{ns}", f".{ns}.svc", f".{ns}.svc.cluster.local"):
            if suffix and not host.endswith(suffix):
                continue
            name = host[: len(host) - len(suffix)] if suffix else host
            svc = self.get("Service", ns, name)
            if svc is not None:
                return svc
        return None

    def pod_for_host(self, ns, host):
        """(workload, pod name) a StatefulSet pod DNS name `<pod>.<svc>` reaches."""
        for w in self.workloads:
            if w.kind != "StatefulSet" or w.ns != ns:
                continue
            svc = w.doc["spec"].get("serviceName")
            for p in w.pod_names:
                for suffix in ("", f".{ns}", f".{ns}.svc", f".{ns}.svc.cluster.local"):
                    if host == f"{p}.{svc}{suffix}":
                        return w, p
        return None, None


# ---------------------------------------------------------------- containers

class Container:
    """One container of one pod: its env resolved and its args expanded."""

    def __init__(self, m, w, c, pod_name, probs):
        self.m, self.w, self.c, self.pod = m, w, c, pod_name
        self.where = f"{w.kind}/{w.name} container {c.get('name')}"
        self.env = {}
        self.env_from_secret = []
        self.resolve_env(probs)
        self.command = [self.expand(a, probs) for a in c.get("command") or []]
        self.args = [self.expand(a, probs) for a in c.get("args") or []]
        self.mounts = {}
        volumes = {v["name"]: v for v in w.spec.get("volumes") or []}
        vcts = {t["metadata"]["name"] for t in w.doc.get("spec", {}).get("volumeClaimTemplates") or []}
        for vm in c.get("volumeMounts") or []:
            v = volumes.get(vm["name"])
            if v is None and vm["name"] in vcts:
                v = {"name": vm["name"], "persistentVolumeClaim": {"claimName": vm["name"]}}
            self.mounts[vm["mountPath"].rstrip("/") or "/"] = (vm, v)

    def expand(self, text, probs):
        out, unresolved = expand(str(text), self.env)
        for u in unresolved:
            probs.add(self.where, f"$({u}) in {text!r} is not an environment variable of the container")
        return out

    def resolve_env(self, probs):
        ns = self.w.ns
        for ef in self.c.get("envFrom") or []:
            if "secretRef" in ef:
                probs.add(self.where, f"envFrom Secret {ef['secretRef'].get('name')}: Secrets must be mounted files, never environment variables")
            if "configMapRef" in ef:
                data = self.m.configmap_data(ns, ef["configMapRef"]["name"])
                if data is None:
                    probs.add(self.where, f"envFrom ConfigMap {ef['configMapRef']['name']} is not defined")
                else:
                    prefix = ef.get("prefix", "")
                    self.env.update({prefix + k: v for k, v in data.items()})
        for e in self.c.get("env") or []:
            name = e["name"]
            if "value" in e:
                val, unresolved = expand(str(e["value"]), self.env)
                self.env[name] = val
                continue
            vf = e.get("valueFrom") or {}
            if "secretKeyRef" in vf:
                probs.add(self.where, f"env {name} comes from Secret {vf['secretKeyRef'].get('name')}: Secrets must be mounted files, never environment variables")
                self.env[name] = "<secret>"
            elif "configMapKeyRef" in vf:
                ref = vf["configMapKeyRef"]
                data = self.m.configmap_data(ns, ref["name"])
                if data is None or ref["key"] not in data:
                    if not ref.get("optional"):
                        probs.add(self.where, f"env {name}: ConfigMap {ref['name']} key {ref['key']} is not defined")
                    continue
                self.env[name] = str(data[ref["key"]])
            elif "fieldRef" in vf:
                path = vf["fieldRef"]["fieldPath"]
                if path == "metadata.name":
                    self.env[name] = self.pod
                elif path == "metadata.namespace":
                    self.env[name] = ns
                elif path == "spec.serviceAccountName":
                    self.env[name] = self.w.spec.get("serviceAccountName", "default")
                elif path in FIELD_PLACEHOLDERS:
                    self.env[name] = FIELD_PLACEHOLDERS[path]
                else:
                    probs.add(self.where, f"env {name}: fieldRef {path} is not one this check knows")
            elif "resourceFieldRef" in vf:
                ref = vf["resourceFieldRef"]
                target = ref.get("containerName", self.c.get("name"))
                cs = [c for c in self.w.containers() if c.get("name") == target]
                if not cs:
                    probs.add(self.where, f"env {name}: resourceFieldRef names container {target}, which does not exist")
                    continue
                kind, res = ref["resource"].split(".", 1)
                amount = ((cs[0].get("resources") or {}).get(kind) or {}).get(res)
                if amount is None:
                    probs.add(self.where, f"env {name}: {ref['resource']} is not set (the node's capacity would be used)")
                    continue
                divisor = parse_quantity(ref.get("divisor", "1"))
                self.env[name] = str(math.ceil(parse_quantity(amount) / divisor))
            else:
                probs.add(self.where, f"env {name} has neither a value nor a source this check knows")

    def mount_for(self, path):
        """(mountPath, volumeMount, volume) holding `path`, the deepest one."""
        best = None
        for mp, (vm, v) in self.mounts.items():
            if path == mp or path.startswith(mp.rstrip("/") + "/"):
                if best is None or len(mp) > len(best[0]):
                    best = (mp, vm, v)
        return best

    def port(self, ref):
        """The containerPort a probe/Service port reference means."""
        for p in self.c.get("ports") or []:
            if ref == p.get("name") or ref == p.get("containerPort"):
                return p
        return None


# ---------------------------------------------------------------- checks

def check_metadata(m, probs):
    for d in m.docs:
        md = d.get("metadata", {})
        kind = d.get("kind")
        if kind not in CLUSTER_SCOPED and md.get("namespace") != m.namespace:
            probs.add(kn(d), f"namespace {md.get('namespace')!r}, not {m.namespace!r}")
        if (md.get("labels") or {}).get(PART_OF[0]) != PART_OF[1]:
            probs.add(kn(d), f"lacks the label {PART_OF[0]}: {PART_OF[1]}")


def check_workload(m, w, probs, args_env):
    where = f"{w.kind}/{w.name}"
    spec = w.doc.get("spec", {})
    if w.kind != "Pod":
        sel = spec.get("selector")
        if w.kind == "Job" and sel is None:
            pass  # generated by the Job controller
        elif not selector_matches(sel, w.labels):
            probs.add(where, f"selector {sel} does not match the pod template's labels {w.labels}")
    if PART_OF[0] not in w.labels:
        probs.add(where, f"pod template lacks the label {PART_OF[0]}")
    ps = w.spec
    sa = ps.get("serviceAccountName")
    if not sa:
        probs.add(where, "pods run as the default ServiceAccount")
    else:
        sa_doc = m.get("ServiceAccount", w.ns, sa)
        if sa_doc is None:
            probs.add(where, f"ServiceAccount {sa} is not defined")
        elif sa_doc.get("automountServiceAccountToken") is not False:
            probs.add(f"ServiceAccount/{sa}", "automountServiceAccountToken is not false")
    if ps.get("automountServiceAccountToken") is not False:
        probs.add(where, "automountServiceAccountToken is not false in the pod spec")
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if ps.get(host):
            probs.add(where, f"{host} is set")
    psc = ps.get("securityContext") or {}
    if psc.get("runAsNonRoot") is not True:
        probs.add(where, "pod securityContext.runAsNonRoot is not true")
    if psc.get("runAsUser") != 65532:
        probs.add(where, f"pod securityContext.runAsUser is {psc.get('runAsUser')}, not 65532")
    if (psc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        probs.add(where, "pod seccompProfile is not RuntimeDefault")
    # Volumes: what they refer to exists.
    vcts = {t["metadata"]["name"] for t in spec.get("volumeClaimTemplates") or []}
    volume_names = set(vcts)
    for v in ps.get("volumes") or []:
        volume_names.add(v["name"])
        for field, kind, name_key, lookup in (
            ("secret", "Secret", "secretName", m.secret_data),
            ("configMap", "ConfigMap", "name", m.configmap_data),
        ):
            if field not in v:
                continue
            name = v[field].get(name_key)
            data = lookup(w.ns, name)
            if data is None:
                if not v[field].get("optional"):
                    probs.add(where, f"volume {v['name']}: {kind} {name} is not defined")
                continue
            for it in v[field].get("items") or []:
                if it["key"] not in data:
                    probs.add(where, f"volume {v['name']}: {kind} {name} has no key {it['key']}")
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            if m.get("PersistentVolumeClaim", w.ns, claim) is None and claim not in vcts:
                probs.add(where, f"volume {v['name']}: PersistentVolumeClaim {claim} is not defined")
        if "hostPath" in v:
            probs.add(where, f"volume {v['name']} is a hostPath")
    for c in w.containers():
        cw = f"{where} container {c.get('name')}"
        for vm in c.get("volumeMounts") or []:
            if vm["name"] not in volume_names:
                probs.add(cw, f"volumeMount {vm['name']} names no volume")
        p = image_problem(c.get("image"))
        if p:
            probs.add(cw, p)
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            probs.add(cw, "allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            probs.add(cw, "is privileged")
        if "ALL" not in ((sc.get("capabilities") or {}).get("drop") or []):
            probs.add(cw, "does not drop ALL capabilities")
        if (sc.get("capabilities") or {}).get("add"):
            probs.add(cw, f"adds capabilities {sc['capabilities']['add']}")
        if sc.get("readOnlyRootFilesystem") is not True:
            probs.add(cw, "readOnlyRootFilesystem is not true")
        elif not any(vm["mountPath"].rstrip("/") == "/tmp" for vm in c.get("volumeMounts") or []):
            probs.add(cw, "has a read-only root file system and no writable /tmp")
        if sc.get("runAsUser") == 0:
            probs.add(cw, "runs as root")
        res = c.get("resources") or {}
        for kind in ("requests", "limits"):
            for r in ("cpu", "memory"):
                if r not in (res.get(kind) or {}):
                    probs.add(cw, f"has no {kind}.{r}")
        if not c.get("command"):
            probs.add(cw, "has no explicit command (the image's entrypoint is not part of the manifests)")
    # Per pod: env, args, binaries, ports, probes, mounted files.
    for pod in w.pod_names:
        for c in w.containers():
            ct = Container(m, w, c, pod, probs)
            args_env.append(ct)


def check_container(m, ct, probs, bin_dir, etcd_flags, expect, facts, first_pod):
    """Flags against the binary, ports and probes against the flags, files
    under mounts, GPU expectations."""
    where = ct.where + (f" (pod {ct.pod})" if ct.w.kind == "StatefulSet" else "")
    cmd = ct.command
    argv = ct.args
    binary = os.path.basename(cmd[0]) if cmd else None
    words = cmd[1:] + argv
    secrets_values = facts["_secret_values"]
    for a in cmd + argv + [v for v in ct.env.values()]:
        for sname, val in secrets_values:
            if val in a:
                probs.add(where, f"the value of Secret {sname} appears in its command line or environment")
    for f in ("--token", "--password"):
        if flag_values(words, f):
            probs.add(where, f"{f} on the command line: pass a file (--token-file) mounted from a Secret")
    if first_pod:
        if binary in ACCRUE_BINARIES:
            run_help(ct, where, bin_dir, binary, words, probs)
        elif binary == "etcd":
            check_etcd_flags(ct, where, words, etcd_flags, probs)
            if etcd_flags.get("_bin"):
                run_help(ct, where, None, etcd_flags["_bin"], words, probs)
        elif binary is not None:
            probs.add(where, f"command {binary}: no way to check its flags")
    # Files named by flags under Secret/ConfigMap mounts are keys there.
    for a in words:
        val = a.split("=", 1)[1] if a.startswith("--") and "=" in a else a
        if not val.startswith("/"):
            continue
        found = ct.mount_for(val)
        if found is None:
            continue
        mp, vm, v = found
        if v is None:
            continue
        rel = val[len(mp):].lstrip("/")
        for src, getter in (("secret", ct.m.secret_data), ("configMap", ct.m.configmap_data)):
            if src not in v:
                continue
            name = v[src].get("secretName") if src == "secret" else v[src].get("name")
            data = getter(ct.w.ns, name)
            if data is None:
                continue
            items = v[src].get("items")
            keys = {it["path"]: it["key"] for it in items} if items else {k: k for k in data}
            if rel and rel not in keys:
                probs.add(where, f"{val}: {src} {name} mounted at {mp} has no key {rel}")
    # What each binary listens on, serves and dials.
    if binary == "accrue-coordinator":
        check_coordinator(ct, where, words, probs, facts)
    elif binary == "accrue-worker" and argv[:1] == ["daemon"]:
        check_worker(ct, where, words, probs, facts, expect)
    elif binary == "etcd":
        check_etcd(ct, where, words, probs, facts)
    elif binary == "accrue":
        check_cli(ct, where, words, probs, facts)
    # GPUs.
    res = ct.c.get("resources") or {}
    gpu = (res.get("limits") or {}).get("nvidia.com/gpu") or (res.get("requests") or {}).get("nvidia.com/gpu")
    if expect == "cpu" and gpu:
        probs.add(where, f"asks for nvidia.com/gpu ({gpu}) in the cpu overlay")
    image = ct.c.get("image", "")
    if image.startswith("ghcr.io/accrue/accrue:"):
        flavour = "cuda" if (expect == "gpu" and binary == "accrue-worker") else "cpu"
        if not image.endswith(f"-{flavour}"):
            probs.add(where, f"image {image}: expected the {flavour} image here")


_HELP_RUNS = {}


def run_help(ct, where, bin_dir, binary, words, probs):
    """Runs the binary with the container's args and `--help` appended: clap
    (accrue) and Go's flag package (etcd) parse every flag and value before
    it, refuse an unknown one, and exit 0 with the usage otherwise."""
    path = os.path.join(bin_dir, binary) if bin_dir else binary
    binary = os.path.basename(binary)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env.update(ct.env)
    key = (path, tuple(words), tuple(sorted(env.items())))
    if key not in _HELP_RUNS:
        try:
            r = subprocess.run([path] + words + ["--help"], capture_output=True, text=True,
                               env=env, timeout=60)
            _HELP_RUNS[key] = (r.returncode, r.stdout, r.stderr)
        except OSError as e:
            _HELP_RUNS[key] = (None, "", f"cannot run {path}: {e}")
    code, out, err = _HELP_RUNS[key]
    if code != 0 or "Usage:" not in out + err:
        lines = (err.strip() or out.strip()).splitlines()
        probs.add(where, f"{binary} refuses its arguments: {lines[0] if lines else code}")


def load_etcd_flags(path):
    flags = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#"):
                name, kind = line.split()
                flags[name] = kind
    return flags


def check_etcd_flags(ct, where, words, etcd_flags, probs):
    version = re.search(r"v?(\d+\.\d+\.\d+)", os.path.basename(etcd_flags["_file"]))
    image = ct.c.get("image", "")
    if version and not re.search(rf":v?{re.escape(version.group(1))}(-\d+)?$", image):
        probs.add(where, f"image {image} is not etcd {version.group(1)}, whose flags {etcd_flags['_file']} lists")
    i = 0
    while i < len(words):
        w = words[i]
        if not w.startswith("-"):
            probs.add(where, f"etcd takes no positional argument {w!r}")
            i += 1
            continue
        name, eq, value = w.lstrip("-").partition("=")
        kind = etcd_flags.get(name)
        if kind is None:
            probs.add(where, f"etcd has no flag --{name}")
        elif kind == "bool":
            if eq and value not in ("true", "false"):
                probs.add(where, f"--{name} is a boolean, not {value!r}")
        elif not eq:
            if i + 1 >= len(words) or words[i + 1].startswith("-"):
                probs.add(where, f"--{name} needs a value")
            else:
                i += 1
        i += 1


def declared_port(ct, where, port, name, probs):
    """The container declares `port` under `name`."""
    ps = [p for p in ct.c.get("ports") or [] if p.get("containerPort") == port]
    if not ps:
        probs.add(where, f"listens on {port} ({name}) but declares no such containerPort")
    elif ps[0].get("name") != name:
        probs.add(where, f"port {port} is named {ps[0].get('name')!r}, not {name!r}")


def check_probe(ct, where, which, probe, paths, port, scheme, probs):
    if probe is None:
        probs.add(where, f"has no {which}")
        return
    hg = probe.get("httpGet")
    if hg is None:
        probs.add(where, f"{which} is not an HTTP GET of what the binary serves")
        return
    if hg.get("path") not in paths:
        probs.add(where, f"{which} asks for {hg.get('path')}, which is not one of {sorted(paths)}")
    p = ct.port(hg.get("port"))
    if p is None:
        probs.add(where, f"{which} port {hg.get('port')!r} is not a port of the container")
    elif p.get("containerPort") != port:
        probs.add(where, f"{which} probes port {p.get('containerPort')}, but the binary serves it on {port}")
    if hg.get("scheme", "HTTP") != scheme:
        probs.add(where, f"{which} scheme {hg.get('scheme', 'HTTP')}, but the endpoint speaks {scheme}")


def cert_fact(ct, flag, words, host, usage, why, facts, probs, where):
    """Record that the certificate file `flag` names must carry `host`."""
    path = flag_value(words, flag)
    if not path:
        return
    found = ct.mount_for(path)
    if not found or not found[2] or "secret" not in found[2]:
        probs.add(where, f"{flag} {path} is not in a mounted Secret")
        return
    mp, _, v = found
    name = v["secret"]["secretName"]
    data = ct.m.secret_data(ct.w.ns, name) or {}
    key = path[len(mp):].lstrip("/")
    if key in data:
        facts["certificates"].append({"secret": name, "key": key, "pem": data[key],
                                      "name": host, "usage": usage, "why": why})


def dialed_service(ct, where, flag, addr, probs, what):
    """The Service and its target pods that `addr` (HOST:PORT) reaches."""
    host, port = host_port(addr)
    svc = ct.m.service_for_host(ct.w.ns, host)
    if svc is None:
        probs.add(where, f"{flag} {addr}: {host} is no Service of namespace {ct.w.ns}")
        return None, []
    ports = svc["spec"].get("ports") or []
    sp = [p for p in ports if p.get("port") == port]
    if not sp:
        probs.add(where, f"{flag} {addr}: Service {svc['metadata']['name']} has no port {port}")
        return svc, []
    targets = ct.m.pods_selected(ct.w.ns, svc["spec"].get("selector"))
    return svc, [(t, sp[0].get("targetPort", port)) for t in targets]


def server_containers(m, targets, binary):
    out = []
    for w, target_port in targets:
        for c in w.spec.get("containers") or []:
            if os.path.basename((c.get("command") or [""])[0]) == binary:
                out.append((w, c, target_port))
    return out


def check_coordinator(ct, where, words, probs, facts):
    grpc = host_port(flag_value(words, "--listen") or "127.0.0.1:50051")[1]
    http = host_port(flag_value(words, "--http") or "127.0.0.1:8080")[1]
    declared_port(ct, where, grpc, "grpc", probs)
    declared_port(ct, where, http, "http", probs)
    scheme = "HTTPS" if flag_value(words, "--tls-cert") else "HTTP"
    c = ct.c
    check_probe(ct, where, "livenessProbe", c.get("livenessProbe"), {"/healthz"}, http, scheme, probs)
    check_probe(ct, where, "readinessProbe", c.get("readinessProbe"), {"/readyz"}, http, scheme, probs)
    if c.get("startupProbe"):
        check_probe(ct, where, "startupProbe", c.get("startupProbe"), {"/healthz"}, http, scheme, probs)
    etcd = flag_values(words, "--etcd")
    if etcd and ct.w.kind == "Deployment" and ct.w.replicas > 1:
        strategy = (ct.w.doc["spec"].get("strategy") or {}).get("type", "RollingUpdate")
        if strategy != "Recreate":
            probs.add(where, "only the leader is ever ready, so a RollingUpdate of several replicas never completes: use strategy Recreate")
    for e in ",".join(etcd).split(",") if etcd else []:
        svc, targets = dialed_service(ct, where, "--etcd", e, probs, "etcd")
        for sw, sc, _ in server_containers(ct.m, targets, "etcd"):
            et = Container(ct.m, sw, sc, sw.pod_names[0], Problems())
            ew = et.command[1:] + et.args
            cert_fact(et, "--cert-file", ew, host_port(e)[0], "server",
                      f"{ct.w.name} dials etcd at {e}", facts, probs, where)
    if etcd and not flag_value(words, "--etcd-cert"):
        probs.add(where, "reaches etcd without a client certificate (--etcd-ca/--etcd-cert/--etcd-key)")


def check_worker(ct, where, words, probs, facts, expect):
    data = host_port(flag_value(words, "--listen-data") or "127.0.0.1:0")[1]
    declared_port(ct, where, data, "data", probs)
    health = flag_value(words, "--health-listen")
    c = ct.c
    if health is None:
        if any(c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")):
            probs.add(where, "has probes but the daemon serves none (no --health-listen)")
        else:
            probs.add(where, "no --health-listen: the kubelet cannot probe the daemon")
    else:
        hp = host_port(health)[1]
        declared_port(ct, where, hp, "health", probs)
        check_probe(ct, where, "livenessProbe", c.get("livenessProbe"), {"/healthz"}, hp, "HTTP", probs)
        check_probe(ct, where, "readinessProbe", c.get("readinessProbe"), {"/readyz"}, hp, "HTTP", probs)
        if c.get("startupProbe"):
            check_probe(ct, where, "startupProbe", c.get("startupProbe"), {"/healthz"}, hp, "HTTP", probs)
    wid = flag_value(words, "--id")
    if wid != ct.pod:
        probs.add(where, f"--id is {wid!r}, not the pod name {ct.pod!r}")
    adv = flag_value(words, "--advertise-data")
    if adv is None:
        probs.add(where, "no --advertise-data: other ranks cannot reach 0.0.0.0")
    else:
        host, port = host_port(adv)
        w, pod = ct.m.pod_for_host(ct.w.ns, host)
        if pod != ct.pod:
            probs.add(where, f"--advertise-data {adv} does not name this pod through a headless Service")
        elif ct.m.get("Service", ct.w.ns, w.doc["spec"].get("serviceName")) is None:
            probs.add(where, f"--advertise-data {adv}: the StatefulSet's serviceName is no Service")
        if port != data:
            probs.add(where, f"--advertise-data port {port} is not the data port {data}")
    stop = float(flag_value(words, "--stop-timeout") or 30)
    grace = ct.w.spec.get("terminationGracePeriodSeconds", 30)
    if grace <= stop + 2:
        probs.add(where, f"terminationGracePeriodSeconds {grace} leaves no time after --stop-timeout {stop:g} (+2 s to detach)")
    coord = flag_value(words, "--coordinator")
    if coord:
        svc, targets = dialed_service(ct, where, "--coordinator", coord, probs, "coordinator")
        for sw, sc, _ in server_containers(ct.m, targets, "accrue-coordinator"):
            cc = Container(ct.m, sw, sc, sw.pod_names[0], Problems())
            cert_fact(cc, "--tls-cert", cc.command[1:] + cc.args, host_port(coord)[0], "server",
                      f"worker {ct.pod} dials {coord}", facts, probs, where)
    cert_fact(ct, "--cert", words, wid or "", "client", f"worker {ct.pod} attaches as {wid}",
              facts, probs, where)
    device = flag_value(words, "--device")
    res = c.get("resources") or {}
    gpu = (res.get("limits") or {}).get("nvidia.com/gpu")
    if expect == "gpu":
        if not gpu or int(gpu) < 1:
            probs.add(where, "the gpu overlay's worker has no nvidia.com/gpu limit")
        if not (device or "").startswith("cuda:"):
            probs.add(where, f"--device is {device!r}, not cuda:N, in the gpu overlay")
        tolerations = ct.w.spec.get("tolerations") or []
        if not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
            probs.add(where, "does not tolerate the nvidia.com/gpu taint")
    elif (device or "").startswith("cuda"):
        probs.add(where, f"--device {device} in the cpu overlay")


def check_etcd(ct, where, words, probs, facts):
    def port_of(flag, default):
        v = flag_value(words, flag)
        return host_port(v.split(",")[0])[1] if v else default
    client = port_of("--listen-client-urls", 2379)
    peer = port_of("--listen-peer-urls", 2380)
    metrics = port_of("--listen-metrics-urls", None)
    declared_port(ct, where, client, "client", probs)
    declared_port(ct, where, peer, "peer", probs)
    c = ct.c
    if metrics is None:
        probs.add(where, "no --listen-metrics-urls: probes would need a client certificate")
    else:
        declared_port(ct, where, metrics, "metrics", probs)
        scheme = "HTTPS" if flag_value(words, "--listen-metrics-urls").startswith("https") else "HTTP"
        check_probe(ct, where, "livenessProbe", c.get("livenessProbe"), ETCD_ALIVE, metrics, scheme, probs)
        check_probe(ct, where, "readinessProbe", c.get("readinessProbe"), ETCD_READY, metrics, scheme, probs)
        if c.get("startupProbe"):
            check_probe(ct, where, "startupProbe", c.get("startupProbe"), ETCD_ALIVE, metrics, scheme, probs)
    name = flag_value(words, "--name")
    if name != ct.pod:
        probs.add(where, f"--name is {name!r}, not the pod name {ct.pod!r}")
    if "--client-cert-auth" not in words and "--client-cert-auth=true" not in words:
        probs.add(where, "etcd does not require client certificates (--client-cert-auth)")
    members = {}
    for entry in (flag_value(words, "--initial-cluster") or "").split(","):
        if "=" in entry:
            n, url = entry.split("=", 1)
            members[n] = url
    if ct.w.kind == "StatefulSet":
        if sorted(members) != sorted(ct.w.pod_names):
            probs.add(where, f"--initial-cluster names {sorted(members)}, but the pods are {ct.w.pod_names}")
        peer_scheme = (flag_value(words, "--listen-peer-urls") or "http://").split("://")[0]
        if peer_scheme == "http":
            check_peer_port_closed(ct, where, peer, probs)
        for n, url in members.items():
            host, port = host_port(url)
            w, pod = ct.m.pod_for_host(ct.w.ns, host)
            if pod != n:
                probs.add(where, f"--initial-cluster {n}={url}: {host} is not that pod's DNS name")
            if port != peer:
                probs.add(where, f"--initial-cluster {n}={url}: not the peer port {peer}")
            if url.startswith("https"):
                cert_fact(ct, "--peer-cert-file", words, host, "server",
                          f"etcd peers dial {url}", facts, probs, where)
        svc = ct.m.get("Service", ct.w.ns, ct.w.doc["spec"].get("serviceName"))
        if svc is None or svc["spec"].get("clusterIP") != "None":
            probs.add(where, "the StatefulSet's serviceName is not a headless Service")
        elif not svc["spec"].get("publishNotReadyAddresses"):
            probs.add(where, f"Service {svc['metadata']['name']} does not publish not-ready members: they cannot find each other to form a quorum")
    for flag in ("--initial-advertise-peer-urls", "--advertise-client-urls"):
        for url in (flag_value(words, flag) or "").split(","):
            if url:
                host, _ = host_port(url)
                _, pod = ct.m.pod_for_host(ct.w.ns, host)
                if pod != ct.pod:
                    probs.add(where, f"{flag} {url} does not name this pod")


def check_peer_port_closed(ct, where, peer, probs):
    """Plaintext peers: the port must be admitted from the members alone, by
    every NetworkPolicy that selects them (and there must be one)."""
    m, w = ct.m, ct.w
    policies = [np for (ns, _), np in m.by_kind.get("NetworkPolicy", {}).items()
                if ns == w.ns and "Ingress" in np["spec"].get("policyTypes", ["Ingress"])
                and selector_matches(np["spec"].get("podSelector") or {}, w.labels)]
    if not policies:
        probs.add(where, "peers speak plain HTTP and no NetworkPolicy selects the members")
        return
    peer_names = {p.get("name") for p in ct.c.get("ports") or [] if p.get("containerPort") == peer}
    for np in policies:
        for rule in np["spec"].get("ingress") or []:
            ports = [p.get("port") for p in rule.get("ports") or []]
            if ports and not any(p == peer or p in peer_names for p in ports):
                continue
            froms = rule.get("from")
            if not froms or any("podSelector" not in f or "namespaceSelector" in f or "ipBlock" in f
                                or not selector_matches(f["podSelector"], w.labels)
                                or any(selector_matches(f["podSelector"], o.labels)
                                       for o in m.workloads if o is not w and o.ns == w.ns)
                                for f in froms):
                probs.add(where, f"peers speak plain HTTP, but NetworkPolicy/{np['metadata']['name']} admits the peer port from others than the members")


def check_cli(ct, where, words, probs, facts):
    coord = flag_value(words, "--coordinator")
    if coord:
        svc, targets = dialed_service(ct, where, "--coordinator", coord, probs, "coordinator")
        for sw, sc, _ in server_containers(ct.m, targets, "accrue-coordinator"):
            cc = Container(ct.m, sw, sc, sw.pod_names[0], Problems())
            cert_fact(cc, "--tls-cert", cc.command[1:] + cc.args, host_port(coord)[0], "server",
                      f"{ct.w.kind}/{ct.w.name} dials {coord}", facts, probs, where)
    if "submit" in ct.args:
        i = ct.args.index("submit")
        spec = next((a for a in ct.args[i + 1:] if not a.startswith("-")), None)
        found = ct.mount_for(spec) if spec else None
        if found and found[2] and "configMap" in found[2]:
            data = ct.m.configmap_data(ct.w.ns, found[2]["configMap"]["name"]) or {}
            key = spec[len(found[0]):].lstrip("/")
            if key in data:
                facts["job_specs"].append({"configmap": found[2]["configMap"]["name"],
                                           "key": key, "text": data[key]})
        else:
            probs.add(where, f"submit {spec}: the spec is not a file of a mounted ConfigMap")
    if ct.w.kind == "Job":
        if ct.w.doc["spec"].get("backoffLimit", 6) != 0 and "submit" in ct.args:
            probs.add(where, "a Job that submits must not be retried (backoffLimit 0): a retry submits again")
        if ct.w.labels.get("accrue.dev/client") != "true":
            probs.add(where, "pods that call the coordinator need the label accrue.dev/client: \"true\" (NetworkPolicy)")


def check_services(m, probs):
    for (ns, name), svc in m.by_kind.get("Service", {}).items():
        where = f"Service/{name}"
        sel = svc["spec"].get("selector")
        pods = m.pods_selected(ns, sel)
        if not pods:
            probs.add(where, f"selector {sel} matches no pod template")
            continue
        for p in svc["spec"].get("ports") or []:
            target = p.get("targetPort", p.get("port"))
            for w in pods:
                if not any(target in (cp.get("name"), cp.get("containerPort")) for cp in w.all_ports()):
                    probs.add(where, f"port {p.get('name')}: targetPort {target!r} is no port of {w.kind}/{w.name}")
    for w in m.workloads:
        if w.kind == "StatefulSet":
            sn = w.doc["spec"].get("serviceName")
            svc = m.get("Service", w.ns, sn)
            if svc is None:
                probs.add(f"StatefulSet/{w.name}", f"serviceName {sn} is no Service")
            elif svc["spec"].get("clusterIP") != "None":
                probs.add(f"StatefulSet/{w.name}", f"Service {sn} is not headless: pods get no DNS names")


def check_pdbs(m, probs):
    for (ns, name), pdb in m.by_kind.get("PodDisruptionBudget", {}).items():
        where = f"PodDisruptionBudget/{name}"
        sel = pdb["spec"].get("selector")
        pods = [w for w in m.workloads if w.ns == ns and selector_matches(sel, w.labels)]
        if len(pods) != 1:
            probs.add(where, f"selects {len(pods)} workloads, not one")
            continue
        replicas = pods[0].replicas
        for field in ("maxUnavailable", "minAvailable"):
            v = pdb["spec"].get(field)
            if isinstance(v, int) and v > replicas:
                probs.add(where, f"{field} {v} exceeds the {replicas} replicas of {pods[0].kind}/{pods[0].name}")
            if isinstance(v, str) and not re.fullmatch(r"(100|[0-9]{1,2})%", v):
                probs.add(where, f"{field} {v!r} is not a count or a percentage")
        if pdb["spec"].get("minAvailable") == replicas:
            probs.add(where, f"minAvailable equals the replicas: no pod may ever be evicted")


def check_network_policies(m, probs):
    deny = False
    for (ns, name), np in m.by_kind.get("NetworkPolicy", {}).items():
        where = f"NetworkPolicy/{name}"
        spec = np["spec"]
        sel = spec.get("podSelector") or {}
        if not sel and "Ingress" in spec.get("policyTypes", []) and not spec.get("ingress"):
            deny = True
            continue
        pods = [w for w in m.workloads if w.ns == ns and selector_matches(sel, w.labels)]
        if not pods:
            probs.add(where, f"podSelector {sel} matches no pod")
            continue
        for rule in spec.get("ingress") or []:
            for port in rule.get("ports") or []:
                pv = port.get("port")
                if "endPort" in port:
                    # A range (the process groups' ephemeral ports, picked
                    # by the kernel at run time): no container declares it;
                    # it must be a numeric, ordered, unprivileged range.
                    end = port["endPort"]
                    if not (isinstance(pv, int) and isinstance(end, int) and 1024 <= pv <= end <= 65535):
                        probs.add(where, f"port range {pv!r}-{end!r} is not an unprivileged numeric range")
                    continue
                for w in pods:
                    if not any(pv in (cp.get("name"), cp.get("containerPort")) for cp in w.all_ports()):
                        probs.add(where, f"port {pv!r} is no port of {w.kind}/{w.name}")
            for peer in rule.get("from") or []:
                ps = peer.get("podSelector")
                if ps is None or "namespaceSelector" in peer:
                    continue
                keys = set((ps.get("matchLabels") or {}).keys())
                if keys and all(k.startswith(CLIENT_LABEL_PREFIX) for k in keys):
                    continue
                if not any(selector_matches(ps, w.labels) for w in m.workloads if w.ns == ns):
                    probs.add(where, f"from podSelector {ps} matches no pod")
    if not deny:
        probs.add("NetworkPolicy", "no default-deny ingress policy (podSelector {} with no ingress rule)")


def check_service_monitors(m, probs):
    for (ns, name), sm in m.by_kind.get("ServiceMonitor", {}).items():
        where = f"ServiceMonitor/{name}"
        sel = sm["spec"].get("selector")
        svcs = [s for (sns, _), s in m.by_kind.get("Service", {}).items()
                if sns == ns and selector_matches(sel, s["metadata"].get("labels") or {})]
        if not svcs:
            probs.add(where, f"selector {sel} matches no Service")
            continue
        for ep in sm["spec"].get("endpoints") or []:
            for s in svcs:
                ports = [p for p in s["spec"].get("ports") or [] if p.get("name") == ep.get("port")]
                if not ports:
                    probs.add(where, f"endpoint port {ep.get('port')!r} is no port of Service {s['metadata']['name']}")
                    continue
                for w in m.pods_selected(ns, s["spec"].get("selector")):
                    for c in w.spec.get("containers") or []:
                        if os.path.basename((c.get("command") or [""])[0]) != "accrue-coordinator":
                            continue
                        ct = Container(m, w, c, w.pod_names[0], Problems())
                        words = ct.command[1:] + ct.args
                        http = host_port(flag_value(words, "--http") or ":8080")[1]
                        target = ports[0].get("targetPort")
                        p = ct.port(target)
                        if p is None or p.get("containerPort") != http:
                            probs.add(where, f"port {ep.get('port')} does not reach the coordinator's --http port {http}")
                        want = "https" if flag_value(words, "--tls-cert") else "http"
                        if ep.get("scheme", "http") != want:
                            probs.add(where, f"scheme {ep.get('scheme', 'http')}, but the coordinator speaks {want}")
                        if ep.get("path", "/metrics") != "/metrics":
                            probs.add(where, f"path {ep.get('path')} is not /metrics")
            bts = ep.get("bearerTokenSecret") or (ep.get("authorization") or {}).get("credentials")
            if not bts:
                probs.add(where, "scrapes without a token: /metrics needs one with the metrics scope")
            else:
                data = m.secret_data(ns, bts.get("name"))
                if data is None or bts.get("key") not in data:
                    probs.add(where, f"token Secret {bts.get('name')} key {bts.get('key')} is not defined")
            ca = ((ep.get("tlsConfig") or {}).get("ca") or {}).get("secret")
            if ca:
                data = m.secret_data(ns, ca.get("name"))
                if data is None or ca.get("key") not in data:
                    probs.add(where, f"CA Secret {ca.get('name')} key {ca.get('key')} is not defined")


def check_pod_groups(m, probs):
    for (ns, name), pg in m.by_kind.get("PodGroup", {}).items():
        where = f"PodGroup/{name}"
        members = [w for w in m.workloads if w.ns == ns and
                   (w.template.get("metadata", {}).get("annotations") or {}).get("scheduling.k8s.io/group-name") == name]
        if not members:
            probs.add(where, "no pod template joins it (annotation scheduling.k8s.io/group-name)")
            continue
        total = sum(w.replicas for w in members)
        if pg["spec"].get("minMember") != total:
            probs.add(where, f"minMember {pg['spec'].get('minMember')} is not the {total} pods that join it")
        for w in members:
            if w.spec.get("schedulerName") != "volcano":
                probs.add(where, f"{w.kind}/{w.name} joins it but is not scheduled by volcano")


def check_set(docs, a, etcd_flags):
    """Every check over one set of objects: (problem lines, facts)."""
    m = Manifests(docs, a.namespace)
    probs = Problems()
    secret_values = []
    for (ns, name), _ in m.by_kind.get("Secret", {}).items():
        for k, v in (m.secret_data(ns, name) or {}).items():
            v = v.strip()
            # Short values (a flag, a port) would match by chance; keys,
            # certificates and tokens are long.
            if len(v) >= 16:
                secret_values.append((f"{name}/{k}", v))
    facts = {"certificates": [], "job_specs": [], "_secret_values": secret_values}
    check_metadata(m, probs)
    containers = []
    for w in m.workloads:
        check_workload(m, w, probs, containers)
    seen = set()
    for ct in containers:
        key = (ct.w.kind, ct.w.name, ct.c.get("name"))
        check_container(m, ct, probs, a.bin_dir, etcd_flags, a.expect, facts, key not in seen)
        seen.add(key)
    check_services(m, probs)
    check_pdbs(m, probs)
    check_network_policies(m, probs)
    check_service_monitors(m, probs)
    check_pod_groups(m, probs)
    if a.expect == "gpu" and not any(
            os.path.basename((c.get("command") or [""])[0]) == "accrue-worker"
            for w in m.workloads for c in w.spec.get("containers") or []):
        probs.add("gpu", "no worker container found")
    del facts["_secret_values"]
    # One line per distinct problem (a StatefulSet's pods repeat them).
    lines = list(dict.fromkeys(probs.items))
    print(f"checked {len(docs)} objects, {len(m.workloads)} workloads, {len(containers)} pod "
          f"containers: {len(lines)} problems", file=sys.stderr)
    return lines, facts


def load_docs(path):
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with open(path) as fh:
        return [d for d in yaml.load_all(fh, Loader=loader) if d]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin-dir", required=True, help="folder of accrue, accrue-coordinator, accrue-worker")
    ap.add_argument("--etcd-flags", required=True, help="the pinned etcd version's flag list")
    ap.add_argument("--etcd-bin", help="an etcd binary to run the etcd container's flags through too")
    ap.add_argument("--expect", choices=("cpu", "gpu"), required=True)
    ap.add_argument("--namespace", default="accrue")
    ap.add_argument("--facts", help="write the certificate and job-spec facts here (JSON)")
    ap.add_argument("--each", action="store_true",
                    help="check every file on its own (lines are prefixed with the file)")
    ap.add_argument("files", nargs="+")
    a = ap.parse_args()
    etcd_flags = load_etcd_flags(a.etcd_flags)
    etcd_flags["_file"] = a.etcd_flags
    etcd_flags["_bin"] = a.etcd_bin
    if a.each:
        bad = False
        for f in a.files:
            lines, _ = check_set(load_docs(f), a, etcd_flags)
            for line in lines:
                print(f"{f}: {line}")
            bad = bad or bool(lines)
        return 1 if bad else 0
    docs = [d for f in a.files for d in load_docs(f)]
    lines, facts = check_set(docs, a, etcd_flags)
    if a.facts:
        with open(a.facts, "w") as f:
            json.dump(facts, f, indent=1)
    for line in lines:
        print(line)
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
