#!/bin/sh
# Writes the Secrets deploy/base refers to, as a kustomize folder:
#   deploy/make-secrets.sh [OUT_DIR]        (default: deploy/secrets)
# with `accrue dev-certs` (a CA, the coordinator's, etcd's and each worker
# pod's certificate, tokens) and a fresh ring master secret. Run it again to
# add workers or renew certificates: a CA (ca.pem + ca.key), tokens.toml and
# ring-master.key already in OUT_DIR are kept.
#
# Environment:
#   ACCRUE_WORKERS    worker pods to issue certificates for (worker-0 ...;
#                     default 8: at least the StatefulSet's replicas)
#   ACCRUE_NAMESPACE  the namespace the coordinator's names carry (accrue)
#   ACCRUE_ETCD       etcd members (default 3: etcd-0 .. etcd-2)
#   ACCRUE_EXTRA_SANS more names for the coordinator's certificate, comma-
#                     separated (the DNS name of a LoadBalancer or Ingress
#                     users reach it at from outside)
#   ACCRUE_BIN        the accrue CLI (default: accrue on PATH)
#
# OUT_DIR holds private keys and the CA key: it is not in git
# (deploy/secrets/.gitignore). ca.key is needed only to issue certificates:
# keep it off the cluster (it never goes into a Secret).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/secrets}
workers=${ACCRUE_WORKERS:-8}
ns=${ACCRUE_NAMESPACE:-accrue}
members=${ACCRUE_ETCD:-3}
accrue=${ACCRUE_BIN:-accrue}

case $workers in ''|*[!0-9]*) echo "ACCRUE_WORKERS must be a number" >&2; exit 2 ;; esac
case $members in ''|*[!0-9]*) echo "ACCRUE_ETCD must be a number" >&2; exit 2 ;; esac
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The names clients dial: the Service, in every form a pod may use.
coordinator_sans="coordinator,coordinator.$ns,coordinator.$ns.svc,coordinator.$ns.svc.cluster.local"
if [ -n "${ACCRUE_EXTRA_SANS:-}" ]; then
  coordinator_sans="$coordinator_sans,$ACCRUE_EXTRA_SANS"
fi
ids=""
i=0
while [ "$i" -lt "$workers" ]; do
  ids="$ids${ids:+,}worker-$i"
  i=$((i + 1))
done
# etcd's certificate: the client Service and every member's name.
etcd_sans="etcd-client,etcd-client.$ns,etcd-client.$ns.svc,etcd-client.$ns.svc.cluster.local"
i=0
while [ "$i" -lt "$members" ]; do
  etcd_sans="$etcd_sans,etcd-$i.etcd,etcd-$i.etcd.$ns.svc,etcd-$i.etcd.$ns.svc.cluster.local"
  i=$((i + 1))
done

# The coordinator's certificate, the workers', the etcd client pair and the
# tokens, signed by the CA in OUT_DIR (made on the first run).
"$accrue" dev-certs "$out" --san "$coordinator_sans" ${ids:+--workers "$ids"} >/dev/null
# etcd's server certificate from the same CA, with etcd's names only.
cp "$out/ca.pem" "$out/ca.key" "$tmp/"
"$accrue" dev-certs "$tmp" --san "$etcd_sans" >/dev/null
cp "$tmp/etcd-server.pem" "$tmp/etcd-server.key" "$out/"
chmod 600 "$out/etcd-server.key"

if [ ! -s "$out/ring-master.key" ]; then
  (umask 077 && head -c 32 /dev/urandom > "$out/ring-master.key")
fi

worker_files=""
i=0
while [ "$i" -lt "$workers" ]; do
  worker_files="$worker_files
  - worker-worker-$i.pem
  - worker-worker-$i.key"
  i=$((i + 1))
done

cat > "$out/kustomization.yaml" <<YAML
# Written by deploy/make-secrets.sh: the Secrets deploy/base mounts, from
# the files next to this one. Not in git.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
namespace: $ns
# Stable names: the kubelet updates mounted files in place when a Secret
# changes (tokens are re-read within a second; worker certificates on the
# next re-attach); see docs/DEPLOY.md, "Rotate secrets".
generatorOptions:
  disableNameSuffixHash: true
  labels:
    app.kubernetes.io/part-of: accrue
secretGenerator:
- name: accrue-coordinator-tls
  files: [ca.pem, coordinator.pem, coordinator.key]
- name: accrue-tokens
  files: [tokens.toml]
- name: accrue-ring-secret
  files: [ring-master.key]
- name: accrue-etcd-client
  files: [ca.pem, etcd-client.pem, etcd-client.key]
- name: etcd-tls
  files: [ca.pem, etcd-server.pem, etcd-server.key]
- name: accrue-worker-certs
  files:
  - ca.pem$worker_files
# For clients inside the cluster (deploy/examples/submit-job.yaml).
- name: accrue-client
  files: [ca.pem, submit.token, read.token]
# For Prometheus (deploy/components/prometheus).
- name: accrue-metrics
  files: [ca.pem, metrics.token]
YAML
echo "wrote the accrue Secrets to $out ($workers worker certificates, $members etcd members, namespace $ns)"
