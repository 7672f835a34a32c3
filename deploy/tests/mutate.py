#!/usr/bin/env python3
"""Breaks rendered manifests in named ways, for the negative cases of
tests/deploy/: each mutation must make check_manifests.py (or
kubernetes-validate) report the problem it introduces.

    mutate.py IN.yaml OUT_DIR MUTATION...   (writes OUT_DIR/MUTATION.yaml each)
    mutate.py --list
"""

import base64
import copy
import os
import sys

import yaml


def find(docs, kind, name):
    for d in docs:
        if d.get("kind") == kind and d["metadata"]["name"] == name:
            return d
    raise SystemExit(f"no {kind}/{name} in the input")


def drop(docs, kind, name):
    d = find(docs, kind, name)
    docs.remove(d)


def pod(docs, kind, name):
    return find(docs, kind, name)["spec"]["template"]["spec"]


def container(docs, kind, name):
    return pod(docs, kind, name)["containers"][0]


def replace_arg(c, prefix, new):
    for i, a in enumerate(c["args"]):
        if a.startswith(prefix):
            c["args"][i] = new
            return
    raise SystemExit(f"no argument {prefix}...")


def probe(c, which):
    return c[which]["httpGet"]


def secret_value(docs, name, key):
    return base64.b64decode(find(docs, "Secret", name)["data"][key]).decode().strip()


MUTATIONS = {
    # images
    "latest-image": lambda d: container(d, "StatefulSet", "worker").update(image="ghcr.io/accrue/accrue:latest"),
    "untagged-image": lambda d: container(d, "Deployment", "coordinator").update(image="ghcr.io/accrue/accrue"),
    # selectors and references
    "service-selector": lambda d: find(d, "Service", "coordinator")["spec"]["selector"].update({"app.kubernetes.io/name": "coordinater"}),
    "deployment-selector": lambda d: find(d, "Deployment", "coordinator")["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/name": "coord"}),
    "missing-secret": lambda d: drop(d, "Secret", "accrue-tokens"),
    "missing-configmap-key": lambda d: find(d, "ConfigMap", "accrue-settings")["data"].pop("ACCRUE_LEASE_TTL"),
    "missing-serviceaccount": lambda d: drop(d, "ServiceAccount", "accrue-worker"),
    "missing-pvc": lambda d: drop(d, "PersistentVolumeClaim", "accrue-checkpoints"),
    "service-target-port": lambda d: find(d, "Service", "coordinator")["spec"]["ports"][1].update(targetPort="https"),
    "netpol-port": lambda d: find(d, "NetworkPolicy", "worker")["spec"]["ingress"][0]["ports"][0].update(port="ring"),
    "netpol-range": lambda d: find(d, "NetworkPolicy", "worker")["spec"]["ingress"][0]["ports"][1].update(port=80),
    "no-default-deny": lambda d: drop(d, "NetworkPolicy", "default-deny-ingress"),
    "namespace": lambda d: find(d, "Deployment", "coordinator")["metadata"].update(namespace="default"),
    # flags against the binaries
    "unknown-flag": lambda d: container(d, "StatefulSet", "worker")["args"].append("--no-such-flag=1"),
    "bad-flag-value": lambda d: find(d, "ConfigMap", "accrue-settings")["data"].update(ACCRUE_LEASE_TTL="three"),
    "unresolved-var": lambda d: replace_arg(container(d, "StatefulSet", "worker"), "--heartbeat=", "--heartbeat=$(ACCRUE_HEARTBEATS)"),
    "etcd-unknown-flag": lambda d: container(d, "StatefulSet", "etcd")["args"].append("--peer-client-cert=/etc/etcd/tls/etcd-client.pem"),
    "etcd-3.5-only-flag": lambda d: container(d, "StatefulSet", "etcd")["args"].append("--peer-client-cert-file=/etc/etcd/tls/etcd-client.pem"),
    "etcd-bad-url": lambda d: replace_arg(container(d, "StatefulSet", "etcd"), "--listen-client-urls=", "--listen-client-urls=0.0.0.0:2379"),
    "etcd-other-version": lambda d: container(d, "StatefulSet", "etcd").update(image="quay.io/coreos/etcd:v3.4.23"),
    "etcd-initial-cluster": lambda d: replace_arg(container(d, "StatefulSet", "etcd"), "--initial-cluster=", "--initial-cluster=etcd-0=http://etcd-0.etcd:2380,etcd-1=http://etcd-1.etcd:2380"),
    "etcd-peer-open": lambda d: find(d, "NetworkPolicy", "etcd")["spec"]["ingress"][1]["from"].append(
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "worker"}}}),
    "etcd-not-published": lambda d: find(d, "Service", "etcd")["spec"].update(publishNotReadyAddresses=False),
    # probes
    "probe-path": lambda d: probe(container(d, "StatefulSet", "worker"), "readinessProbe").update(path="/ready"),
    "probe-port": lambda d: probe(container(d, "Deployment", "coordinator"), "readinessProbe").update(port="grpc"),
    "probe-scheme": lambda d: probe(container(d, "Deployment", "coordinator"), "livenessProbe").update(scheme="HTTP"),
    "listen-port": lambda d: replace_arg(container(d, "StatefulSet", "worker"), "--health-listen=", "--health-listen=0.0.0.0:9090"),
    # workers
    "advertise-data": lambda d: replace_arg(container(d, "StatefulSet", "worker"), "--advertise-data=", "--advertise-data=$(POD_NAME).workers:29500"),
    "more-workers-than-certs": lambda d: find(d, "StatefulSet", "worker")["spec"].update(replicas=9),
    "short-grace": lambda d: pod(d, "StatefulSet", "worker").update(terminationGracePeriodSeconds=30),
    "gpu-in-cpu": lambda d: container(d, "StatefulSet", "worker")["resources"]["limits"].update({"nvidia.com/gpu": 1}),
    "gpu-no-limit": lambda d: container(d, "StatefulSet", "worker")["resources"]["limits"].pop("nvidia.com/gpu"),
    "gpu-no-toleration": lambda d: pod(d, "StatefulSet", "worker").pop("tolerations"),
    "gpu-cpu-device": lambda d: replace_arg(container(d, "StatefulSet", "worker"), "--device=", "--device=cpu"),
    # coordinators
    "rolling-coordinator": lambda d: find(d, "Deployment", "coordinator")["spec"].update(strategy={"type": "RollingUpdate"}),
    # budgets
    "pdb-exceeds": lambda d: find(d, "PodDisruptionBudget", "worker")["spec"].update(maxUnavailable=5),
    # secrets and security
    "secret-env": lambda d: container(d, "StatefulSet", "worker")["env"].append(
        {"name": "ACCRUE_TOKEN", "valueFrom": {"secretKeyRef": {"name": "accrue-client", "key": "submit.token"}}}),
    "secret-in-args": lambda d: container(d, "Job", "accrue-submit-digits")["args"].insert(
        0, "--token=" + secret_value(d, "accrue-client", "submit.token")),
    "root": lambda d: pod(d, "Deployment", "coordinator")["securityContext"].update(runAsUser=0),
    "writable-root": lambda d: container(d, "StatefulSet", "etcd")["securityContext"].update(readOnlyRootFilesystem=False),
    "token-mounted": lambda d: pod(d, "StatefulSet", "worker").update(automountServiceAccountToken=True),
    "no-limits": lambda d: container(d, "Deployment", "coordinator")["resources"].pop("limits"),
    "job-retried": lambda d: find(d, "Job", "accrue-submit-digits")["spec"].update(backoffLimit=3),
    # components
    "podgroup-min-member": lambda d: find(d, "PodGroup", "accrue-workers")["spec"].update(minMember=1),
    "servicemonitor-port": lambda d: find(d, "ServiceMonitor", "coordinator")["spec"]["endpoints"][0].update(port="metrics"),
    "servicemonitor-token": lambda d: find(d, "ServiceMonitor", "coordinator")["spec"]["endpoints"][0]["bearerTokenSecret"].update(key="token"),
    # kubernetes-validate --strict
    "unknown-field": lambda d: container(d, "StatefulSet", "worker").update(imagePullPolicyy="Always"),
}


def main():
    if sys.argv[1:] == ["--list"]:
        print("\n".join(MUTATIONS))
        return 0
    src, out_dir, names = sys.argv[1], sys.argv[2], sys.argv[3:]
    with open(src) as f:
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        docs = [d for d in yaml.load_all(f, Loader=loader) if d]
    os.makedirs(out_dir, exist_ok=True)
    for name in names:
        mutated = copy.deepcopy(docs)
        MUTATIONS[name](mutated)
        with open(os.path.join(out_dir, f"{name}.yaml"), "w") as f:
            yaml.dump_all(mutated, f, sort_keys=False,
                          Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))
    return 0


if __name__ == "__main__":
    sys.exit(main())
