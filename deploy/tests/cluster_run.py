#!/usr/bin/env python3
"""A cluster run driven by the rendered manifests (issue 15).

Reads a rendered overlay (kubectl kustomize output) and runs every pod of its
workloads as local processes, as a kubelet and the controllers would:

- one network namespace per pod, all on one bridge inside a "cluster"
  namespace; pod IPs 10.213.1.N, ClusterIP Service IPs 10.213.2.N;
- each pod's /etc/hosts names the Services (svc, svc.NS, svc.NS.svc,
  svc.NS.svc.cluster.local) and the pods of headless Services
  (pod.svc ...), as cluster DNS would;
- each container runs chrooted into a root folder (the image's runtime
  tree, see deploy/images/assemble-runtime.sh; etcd: the host's etcd) as the
  pod's runAsUser, in its own mount namespace with its volumes mounted at
  their mountPaths (Secrets and ConfigMaps written with defaultMode, owned by
  the pod's fsGroup; PVCs shared folders; emptyDirs), with its env from the
  manifest (downward API, resourceFieldRef, configMapKeyRef) and $(VAR)
  expanded in command and args as the kubelet does;
- probes are polled from the cluster namespace (httpGet; HTTPS without
  verification, as the kubelet does); a userspace proxy per ClusterIP
  Service port forwards to ready endpoints only;
- the bridge's MAC is fixed and each pod's follows its IP (a StatefulSet
  pod restarted under its address is reached at once, as a CNI's
  gratuitous ARP would make it);
- WORK/harness.log has, timestamped, each readiness change, kill and
  start, and each Service connection's endpoint (or why there was none).

Needs root (network namespaces, mounts, chroot). Nothing in a command line is
written here: it all comes from the rendered YAML.

`run REPO BIN_DIR WORKDIR` (what tests/cluster_run.rs calls): deploy/ is
copied, its Secrets made with this build's CLI (deploy/make-secrets.sh), the
cpu overlay rendered with the venv's kubectl; the pods of every workload
start; once etcd, the workers and one leading coordinator are ready, the
example Job (deploy/examples/submit-job.yaml, `accrue submit --wait` through
the coordinator Service) runs; at a sixth of the job the leader coordinator
pod and worker-1 are killed with SIGKILL and replaced as their controllers
would (a new Deployment pod; the StatefulSet pod under its name and
address). It passes when the submit Job exits 0, the final parameters
equal, bit for bit, an undisturbed `accrue local` run of the same spec with
the same world size and intra-op threads (the worker's CPU limit), and the
CLI on this host submits a small job from outside and it succeeds, through
a loopback port forwarded to the coordinator Service (`kubectl
port-forward`; the coordinator's certificate names localhost).

What it does not do: a real kubelet, CNI, kube-proxy or DNS; NetworkPolicies
are not enforced; images are the runtime tree (etcd: the host's etcd 3.4 in
a tree of its own), not pulled images; PVCs are host folders.

"""

import base64
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request


from check_manifests import expand as expand_vars, labels_match, load_docs, parse_quantity

NS_PREFIX = "acc"
CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
BRIDGE_IP = "10.213.0.1"


EVENTS = None  # the harness's own log (probe changes, Service routing)


def event(msg):
    """One timestamped line in WORK/harness.log: what the kubelet and the
    Service proxies decided, to read beside the pods' logs."""
    if EVENTS is not None:
        EVENTS.write(f"{time.strftime('%H:%M:%S')}.{int(time.time() * 1000) % 1000:03d} {msg}\n")
        EVENTS.flush()


def sh(*args, check=True, netns=None, capture=False):
    cmd = list(args)
    if netns:
        cmd = ["ip", "netns", "exec", netns] + cmd
    r = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip()}")
    return r.stdout if capture else r


class Objects:
    """The rendered objects, by kind and name."""

    def __init__(self, docs):
        self.docs = docs

    def of(self, kind):
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind, name):
        for d in self.of(kind):
            if d["metadata"]["name"] == name:
                return d
        raise KeyError(f"no {kind} {name} in the rendered manifests")


class Net:
    """The cluster namespace with its bridge; pod namespaces on veth pairs."""

    def __init__(self, tag):
        self.tag = tag
        self.cluster = f"{NS_PREFIX}{tag}-net"
        self.next_pod = 1
        self.next_svc = 1
        self.pods = {}
        self.next_veth = 0

    def up(self):
        sh("ip", "netns", "add", self.cluster)
        sh("ip", "link", "set", "lo", "up", netns=self.cluster)
        sh("ip", "link", "add", "br0", "type", "bridge", netns=self.cluster)
        # A bridge takes the lowest MAC of its ports unless one is set: as
        # pods came and went the gateway's MAC changed under the pods' ARP
        # caches, and their packets to Services were dropped until the
        # cache entries went stale (10 to 50 s; the flake of 2ae5089).
        sh("ip", "link", "set", "br0", "address", mac(BRIDGE_IP), netns=self.cluster)
        sh("ip", "addr", "add", f"{BRIDGE_IP}/16", "dev", "br0", netns=self.cluster)
        sh("ip", "link", "set", "br0", "up", netns=self.cluster)

    def service_ip(self):
        ip = f"10.213.2.{self.next_svc}"
        self.next_svc += 1
        # The proxy listens on it inside the cluster namespace.
        sh("ip", "addr", "add", f"{ip}/32", "dev", "br0", netns=self.cluster)
        return ip

    def pod(self, name, ip=None):
        """A namespace for pod `name` (its IP kept across restarts)."""
        ns = f"{NS_PREFIX}{self.tag}-{name}"[:48]
        if ip is None:
            ip = f"10.213.1.{self.next_pod}"
            self.next_pod += 1
        veth = f"v{self.tag}x{self.next_veth}"[:15]
        self.next_veth += 1
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "set", "lo", "up", netns=ns)
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns,
           netns=self.cluster)
        sh("ip", "link", "set", veth, "master", "br0", netns=self.cluster)
        sh("ip", "link", "set", veth, "up", netns=self.cluster)
        # The MAC follows the IP, so a pod restarted under its address (a
        # StatefulSet pod here) is reached at once through its peers'
        # ARP caches.
        sh("ip", "link", "set", "eth0", "address", mac(ip), netns=ns)
        sh("ip", "addr", "add", f"{ip}/16", "dev", "eth0", netns=ns)
        sh("ip", "link", "set", "eth0", "up", netns=ns)
        sh("ip", "route", "add", "default", "via", BRIDGE_IP, netns=ns)
        self.pods[name] = (ns, veth)
        return ns, ip

    def drop_pod(self, name):
        ns, veth = self.pods.pop(name)
        sh("ip", "link", "del", veth, netns=self.cluster, check=False)
        sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)

    def down(self):
        for name in list(self.pods):
            self.drop_pod(name)
        sh("ip", "netns", "del", self.cluster, check=False)


def mac(ip):
    """A locally administered MAC address that follows an IPv4 address."""
    return "02:00:" + ":".join(f"{int(o):02x}" for o in ip.split("."))


def setns_fd(fd):
    """Moves the calling thread into the network namespace `fd` names."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
        raise OSError(ctypes.get_errno(), "setns")


def enter(netns):
    """Moves the calling thread (and the threads it starts) into `netns`."""
    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        setns_fd(fd)
    finally:
        os.close(fd)


def host_tree(binary, tree):
    """A root folder holding `binary` at /usr/local/bin and the libraries
    the loader resolves for it at their own paths (for images not built
    here, e.g. etcd's)."""
    dest = os.path.join(tree, "usr/local/bin", os.path.basename(binary))
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copy(binary, dest)
    os.makedirs(os.path.join(tree, "etc"), exist_ok=True)
    out = sh("ldd", binary, capture=True, check=False)
    for line in out.splitlines():
        parts = line.split()
        path = parts[2] if "=>" in parts and len(parts) > 2 else parts[0]
        if path.startswith("/"):
            real = os.path.join(tree, path.lstrip("/"))
            os.makedirs(os.path.dirname(real), exist_ok=True)
            shutil.copy(path, real)


def quantity(q, divisor):
    """A resource quantity divided by `divisor`, rounded up (as the
    downward API's resourceFieldRef does)."""
    v = parse_quantity(q) / parse_quantity(divisor)
    return str(int(v) if v == int(v) else int(v) + 1)


def expand(text, env):
    """$(VAR) expansion as the kubelet does (check_manifests.expand)."""
    return expand_vars(text, env)[0]


class PodSpec:
    """One pod of a workload: what its first container runs, with what."""

    def __init__(self, objs, workload, name, ip):
        self.objs = objs
        self.workload = workload
        self.name = name
        self.ip = ip
        self.template = workload["spec"]["template"]
        self.spec = self.template["spec"]
        self.labels = self.template["metadata"].get("labels", {})
        self.container = self.spec["containers"][0]
        sc = self.spec.get("securityContext", {})
        self.uid = self.container.get("securityContext", {}).get("runAsUser", sc.get("runAsUser", 0))
        self.gid = sc.get("runAsGroup", self.uid)
        self.fs_group = sc.get("fsGroup")

    def ports(self):
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", []) if "name" in p}

    def port(self, p):
        return self.ports()[p] if isinstance(p, str) else p

    def env(self):
        out = {}
        limits = self.container.get("resources", {}).get("limits", {})
        for e in self.container.get("env", []):
            if "value" in e:
                out[e["name"]] = expand(str(e["value"]), out)
                continue
            src = e["valueFrom"]
            if "fieldRef" in src:
                path = src["fieldRef"]["fieldPath"]
                out[e["name"]] = {
                    "metadata.name": self.name,
                    "metadata.namespace": self.workload["metadata"].get("namespace", "default"),
                    "status.podIP": self.ip,
                }[path]
            elif "resourceFieldRef" in src:
                r = src["resourceFieldRef"]
                out[e["name"]] = quantity(limits[r["resource"].split(".", 1)[1]], r.get("divisor", "1"))
            elif "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                out[e["name"]] = self.objs.get("ConfigMap", ref["name"])["data"][ref["key"]]
            elif "secretKeyRef" in src:
                raise ValueError(f"{self.name}: a Secret in env ({e['name']}): Secrets are files")
            else:
                raise ValueError(f"{self.name}: env {e['name']}: unsupported {src}")
        return out

    def argv(self):
        env = self.env()
        return [expand(a, env) for a in self.container.get("command", []) + self.container.get("args", [])], env


def write_volume_files(dest, items, mode, gid):
    os.makedirs(dest, exist_ok=True)
    for key, data in items.items():
        p = os.path.join(dest, key)
        with open(p, "wb") as f:
            f.write(data)
        os.chmod(p, mode)
        if gid is not None:
            os.chown(p, 0, gid)
    if gid is not None:
        os.chown(dest, 0, gid)


class Runner:
    """Starts and stops pods: root folder, mounts, chroot, env."""

    def __init__(self, objs, net, work, trees):
        self.objs = objs
        self.net = net
        self.work = work
        self.trees = trees  # image -> runtime tree folder
        self.procs = {}
        self.shared = os.path.join(work, "pvc")

    def volume_source(self, pod, vol):
        """A host folder holding the volume's content."""
        base = os.path.join(self.work, "pods", pod.name, "volumes", vol["name"])
        if "secret" in vol:
            s = self.objs.get("Secret", vol["secret"]["secretName"])
            items = {k: base64.b64decode(v) for k, v in s.get("data", {}).items()}
            write_volume_files(base, items, vol["secret"].get("defaultMode", 0o644), pod.fs_group)
            return base
        if "configMap" in vol:
            c = self.objs.get("ConfigMap", vol["configMap"]["name"])
            items = {k: v.encode() for k, v in c.get("data", {}).items()}
            write_volume_files(base, items, vol["configMap"].get("defaultMode", 0o644), pod.fs_group)
            return base
        if "emptyDir" in vol:
            os.makedirs(base, exist_ok=True)
            os.chmod(base, 0o1777)
            return base
        if "persistentVolumeClaim" in vol:
            d = os.path.join(self.shared, vol["persistentVolumeClaim"]["claimName"])
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o777)
            return d
        raise ValueError(f"{pod.name}: volume {vol['name']}: unsupported kind {vol}")

    def claim_template(self, pod, name):
        d = os.path.join(self.shared, f"{name}-{pod.name}")
        os.makedirs(d, exist_ok=True)
        if pod.fs_group is not None:
            os.chown(d, pod.uid, pod.fs_group)
        return d

    def start(self, pod, hosts_text):
        ns, _ = self.net.pod(pod.name, pod.ip)
        image = pod.container["image"]
        tree = self.trees[image]
        root = os.path.join(self.work, "pods", pod.name, "root")
        shutil.rmtree(root, ignore_errors=True)
        # The tree's folders, bind-mounted read-only; the pod's own /etc.
        os.makedirs(root)
        for d in os.listdir(tree):
            src = os.path.join(tree, d)
            if os.path.islink(src):
                os.symlink(os.readlink(src), os.path.join(root, d))
            elif os.path.isdir(src) and d != "etc":
                os.makedirs(os.path.join(root, d))
        shutil.copytree(os.path.join(tree, "etc"), os.path.join(root, "etc"), dirs_exist_ok=True)
        with open(os.path.join(root, "etc", "hosts"), "w") as f:
            f.write(f"{pod.ip} {pod.name}\n" + hosts_text)
        for d in ("proc", "dev", "tmp"):
            os.makedirs(os.path.join(root, d), exist_ok=True)
        mounts = []
        for d in os.listdir(tree):
            src = os.path.join(tree, d)
            if os.path.isdir(src) and not os.path.islink(src) and d not in ("etc",):
                mounts.append(f"mount --bind -o ro {q(src)} {q(os.path.join(root, d))}")
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        templates = {t["metadata"]["name"] for t in pod.workload["spec"].get("volumeClaimTemplates", [])}
        for m in pod.container.get("volumeMounts", []):
            if m["name"] in templates:
                src = self.claim_template(pod, m["name"])
            else:
                src = self.volume_source(pod, volumes[m["name"]])
            dest = os.path.join(root, m["mountPath"].lstrip("/"))
            os.makedirs(dest, exist_ok=True)
            ro = ",ro" if m.get("readOnly") else ""
            mounts.append(f"mount --bind {q(src)} {q(dest)}")
            if ro:
                mounts.append(f"mount -o remount,bind,ro {q(dest)}")
        mounts.append(f"mount -t proc proc {q(os.path.join(root, 'proc'))}")
        mounts.append(f"mount -t tmpfs -o mode=755 none {q(os.path.join(root, 'dev'))}")
        for n in ("null", "zero", "full", "random", "urandom"):
            target = os.path.join(root, "dev", n)
            mounts.append(f"touch {q(target)} && mount --bind /dev/{n} {q(target)}")
        argv, env = pod.argv()
        env = dict(env)
        env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["HOSTNAME"] = pod.name
        envs = " ".join(q(f"{k}={v}") for k, v in env.items())
        script = " && ".join(mounts) + (
            f" && exec /usr/bin/env -i {envs} {CHROOT} --userspec={pod.uid}:{pod.gid} {q(root)} "
            + " ".join(q(a) for a in argv)
        )
        log = open(os.path.join(self.work, f"{pod.name}.log"), "ab")
        p = subprocess.Popen(
            ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private",
             "sh", "-c", script],
            stdout=log, stderr=log, start_new_session=True,
        )
        self.procs[pod.name] = p
        return p

    def kill(self, name):
        p = self.procs.pop(name, None)
        if p and p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
        self.net.drop_pod(name)


def q(s):
    return "'" + str(s).replace("'", "'\\''") + "'"


def probe(pod, pr):
    """One kubelet probe of `pod`: True when it passes."""
    if "httpGet" in pr:
        g = pr["httpGet"]
        scheme = g.get("scheme", "HTTP").lower()
        url = f"{scheme}://{pod.ip}:{pod.port(g['port'])}{g.get('path', '/')}"
        ctx = ssl._create_unverified_context() if scheme == "https" else None
        try:
            with urllib.request.urlopen(url, timeout=pr.get("timeoutSeconds", 1), context=ctx) as r:
                return 200 <= r.status < 400
        except Exception:
            return False
    if "tcpSocket" in pr:
        try:
            with socket.create_connection((pod.ip, pod.port(pr["tcpSocket"]["port"])), timeout=1):
                return True
        except OSError:
            return False
    raise ValueError(f"{pod.name}: unsupported probe {pr}")


class Proxy:
    """A ClusterIP Service port: accepts on the Service IP and forwards each
    connection to a ready endpoint (round robin)."""

    def __init__(self, ip, port, target, endpoints, name):
        self.endpoints = endpoints  # callable -> [(ip, port)]
        self.name = f"{name}:{port}"
        self.target = target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ip, port))
        self.sock.listen(64)
        self.n = 0
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            c, _ = self.sock.accept()
            eps = self.endpoints()
            if not eps:
                event(f"service {self.name}: no ready endpoint, connection closed")
                c.close()
                continue
            ep = eps[self.n % len(eps)]
            self.n += 1
            if not self.name.endswith(":8080"):  # the harness's own polling
                event(f"service {self.name}: connection to {ep[0]}:{ep[1]}")
            threading.Thread(target=self.pipe, args=(c, ep, self.name), daemon=True).start()

    @staticmethod
    def pipe(c, ep, name="forward"):
        try:
            u = socket.create_connection(ep, timeout=5)
        except OSError as e:
            event(f"service {name}: {ep[0]}:{ep[1]} unreachable: {e}")
            c.close()
            return
        u.settimeout(None)

        def copy(a, b):
            try:
                while True:
                    data = a.recv(65536)
                    if not data:
                        break
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=copy, args=(c, u), daemon=True).start()
        copy(u, c)


class Cluster:
    """The controllers and the kubelet: desired pods kept running, probes
    polled, Service endpoints = ready pods."""

    def __init__(self, objs, net, runner, ns="accrue"):
        self.objs = objs
        self.net = net
        self.runner = runner
        self.ns = ns
        self.pods = {}  # name -> PodSpec
        self.ready = {}
        self.lock = threading.Lock()
        self.services = {}  # ClusterIP Service name -> VIP
        self.next_ip = 10
        self.stopped = False

    def ip(self):
        ip = f"10.213.1.{self.next_ip}"
        self.next_ip += 1
        return ip

    def desired(self):
        """Every pod the workloads ask for (StatefulSet names are stable;
        Deployment pods get a fresh suffix)."""
        out = []
        for sts in self.objs.of("StatefulSet"):
            for i in range(sts["spec"].get("replicas", 1)):
                out.append((sts, f"{sts['metadata']['name']}-{i}"))
        for dep in self.objs.of("Deployment"):
            for i in range(dep["spec"].get("replicas", 1)):
                out.append((dep, f"{dep['metadata']['name']}-{os.urandom(3).hex()}"))
        return out

    def hosts(self):
        ns = self.ns
        lines = ["127.0.0.1 localhost"]
        for name, ip in self.services.items():
            lines.append(f"{ip} {name} {name}.{ns} {name}.{ns}.svc {name}.{ns}.svc.cluster.local")
        for svc in self.objs.of("Service"):
            if svc["spec"].get("clusterIP") != "None":
                continue
            sname = svc["metadata"]["name"]
            for p in self.pods.values():
                if labels_match(svc["spec"]["selector"], p.labels):
                    lines.append(
                        f"{p.ip} {p.name}.{sname} {p.name}.{sname}.{ns} "
                        f"{p.name}.{sname}.{ns}.svc {p.name}.{sname}.{ns}.svc.cluster.local")
        return "\n".join(lines) + "\n"

    def start_services(self):
        for svc in self.objs.of("Service"):
            if svc["spec"].get("clusterIP") == "None":
                continue
            name = svc["metadata"]["name"]
            vip = self.net.service_ip()
            self.services[name] = vip
            for port in svc["spec"]["ports"]:
                Proxy(vip, port["port"], port.get("targetPort", port["port"]),
                      self.endpoints(svc["spec"]["selector"], port.get("targetPort", port["port"])),
                      name)

    def endpoints(self, selector, target):
        def eps():
            with self.lock:
                return [(p.ip, p.port(target)) for p in self.pods.values()
                        if labels_match(selector, p.labels) and self.ready.get(p.name)]
        return eps

    def plan(self):
        for wl, name in self.desired():
            self.pods[name] = PodSpec(self.objs, wl, name, self.ip())

    def start_all(self):
        hosts = self.hosts()
        for p in self.pods.values():
            self.runner.start(p, hosts)

    def probe_loop(self):
        while not self.stopped:
            for p in list(self.pods.values()):
                pr = p.container.get("readinessProbe")
                ok = probe(p, pr) if pr else True
                with self.lock:
                    if p.name not in self.pods or self.pods[p.name] is not p:
                        continue  # killed while being probed
                    if self.ready.get(p.name) != ok:
                        event(f"probe: {p.name} ({p.ip}) {'ready' if ok else 'not ready'}")
                    self.ready[p.name] = ok
            time.sleep(0.5)

    def kill(self, name, replace):
        """kill -9 of pod `name`; the controller starts its replacement:
        the same name and address (StatefulSet) or a new pod (Deployment)."""
        event(f"kill -9 {name}")
        with self.lock:
            old = self.pods.pop(name)
            self.ready.pop(name, None)
        self.runner.kill(name)
        if not replace:
            return None
        if old.workload["kind"] == "StatefulSet":
            new = PodSpec(self.objs, old.workload, name, old.ip)
        else:
            base = old.workload["metadata"]["name"]
            new = PodSpec(self.objs, old.workload, f"{base}-{os.urandom(3).hex()}", self.ip())
        with self.lock:
            self.pods[new.name] = new
        self.runner.start(new, self.hosts())
        event(f"started {new.name} ({new.ip})")
        return new.name


OUTSIDE_JOB = """
name = "outside"
workers = 2
seed = 5
max_steps = 4
device = "cpu"
threads = 1
[model]
kind = "mlp"
hidden = [16]
[data]
kind = "synthetic"
samples = 256
shape = [8]
classes = 3
batch_size = 8
[accumulation]
steps = 2
[optimizer]
kind = "sgd"
lr = 0.1
"""


def forward_loop(listener, target):
    """Accepts on `listener` (this host's loopback) and pipes each
    connection to `target` (inside the cluster namespace)."""
    while True:
        c, _ = listener.accept()
        threading.Thread(target=Proxy.pipe, args=(c, target), daemon=True).start()


def https_json(url, token, timeout=3):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=timeout, context=ssl._create_unverified_context()) as r:
        return json.load(r)


def render(repo, work, bin_dir):
    """deploy/ copied into `work`, its Secrets made with this build's CLI,
    the cpu overlay rendered with the venv's kubectl: (rendered YAML path,
    secrets folder)."""
    deploy = os.path.join(work, "deploy")
    shutil.copytree(os.path.join(repo, "deploy"), deploy, ignore=shutil.ignore_patterns("secrets"))
    env = dict(os.environ, ACCRUE_BIN=os.path.join(bin_dir, "accrue"), ACCRUE_WORKERS="4")
    subprocess.run(["sh", os.path.join(deploy, "make-secrets.sh")], check=True, env=env,
                   stdout=subprocess.DEVNULL)
    kubectl = os.path.join(repo, ".venv", "bin", "kubectl")
    out = sh(kubectl, "kustomize", os.path.join(deploy, "overlays", "cpu"), capture=True)
    rendered = os.path.join(work, "cpu.yaml")
    with open(rendered, "w") as f:
        f.write(out)
    return rendered, os.path.join(deploy, "secrets")


def compare(a, b):
    """The largest absolute difference between two model.safetensors files
    (None: different tensor names or shapes)."""
    import numpy as np
    from safetensors.numpy import load_file
    x, y = load_file(a), load_file(b)
    if sorted(x) != sorted(y) or any(x[k].shape != y[k].shape for k in x):
        return None
    return max(float(np.abs(x[k].astype(np.float64) - y[k]).max()) for k in x)


def run(repo, bin_dir, work):
    """The cpu overlay end to end: a job submitted through the coordinator
    Service by the example Job; the leader coordinator pod and worker-1
    killed mid-job and replaced as their controllers would; the submit Job
    must succeed and the final parameters equal an undisturbed run's
    (`accrue local` with the same spec, world size and threads)."""
    os.makedirs(work, exist_ok=True)
    global EVENTS
    EVENTS = open(os.path.join(work, "harness.log"), "a")
    bins = [os.path.join(bin_dir, b) for b in ("accrue", "accrue-coordinator", "accrue-worker")]
    rendered, secrets = render(repo, work, bin_dir)
    example = os.path.join(repo, "deploy", "examples", "submit-job.yaml")
    objs = Objects(load_docs(rendered) + load_docs(example))
    tree = os.path.join(work, "accrue-tree")
    sh(os.path.join(repo, "deploy/images/assemble-runtime.sh"), "--link", tree, *bins)
    etcd_tree = os.path.join(work, "etcd-tree")
    host_tree(shutil.which("etcd"), etcd_tree)
    trees = {}
    for d in objs.docs:
        if d["kind"] in ("StatefulSet", "Deployment", "Job"):
            img = d["spec"]["template"]["spec"]["containers"][0]["image"]
            trees[img] = etcd_tree if "/etcd:" in img else tree
    tag = str(os.getpid() % 10000)
    net = Net(tag)
    net.up()
    runner = Runner(objs, net, work, trees)
    # The data volume holds the digits (the spec's relative path).
    shutil.copytree(os.path.join(repo, "data", "digits"),
                    os.path.join(runner.shared, "accrue-data", "digits"))
    cluster = Cluster(objs, net, runner)
    result = {"killed": [], "submit_exit": None}
    # `kubectl port-forward svc/coordinator`: a port on this host's
    # loopback (bound before this thread moves into the cluster namespace)
    # forwarded to the Service.
    forward = socket.socket()
    forward.bind(("127.0.0.1", 0))
    forward.listen(16)
    host_ns = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter(net.cluster)
        cluster.start_services()
        cluster.plan()
        cluster.start_all()
        threading.Thread(target=cluster.probe_loop, daemon=True).start()
        coord = f"https://{cluster.services['coordinator']}:8080"
        read = open(os.path.join(secrets, "read.token")).read().strip()
        # Ready: every etcd member and worker, and one leading coordinator
        # that has kept the lead for 5 s (etcd's first elections can depose
        # the first leader; a user would wait for a settled rollout too).
        deadline = time.time() + 120
        settled = (None, 0.0)
        while time.time() < deadline:
            with cluster.lock:
                ready = dict(cluster.ready)
            leaders = [n for n in cluster.pods if n.startswith("coordinator") and ready.get(n)]
            others = [n for n in cluster.pods if not n.startswith("coordinator")]
            if len(leaders) == 1 and all(ready.get(n) for n in others):
                if settled[0] != leaders[0]:
                    settled = (leaders[0], time.time())
                elif time.time() - settled[1] >= 5:
                    break
            else:
                settled = (None, 0.0)
            time.sleep(0.5)
        else:
            raise RuntimeError(f"the cluster did not become ready: {ready}")
        print("ready:", json.dumps(ready), flush=True)
        job = objs.get("Job", "accrue-submit-digits")
        submit = PodSpec(objs, job, "accrue-submit-digits-x1", cluster.ip())
        cluster.pods[submit.name] = submit
        p = runner.start(submit, cluster.hosts())
        deadline = time.time() + 600
        while p.poll() is None and time.time() < deadline:
            try:
                jobs = https_json(f"{coord}/v1/jobs", read)["jobs"]
            except Exception:
                jobs = []
            step = jobs[0]["counters"].get("step", 0) if jobs else 0
            total = jobs[0]["counters"].get("total_steps", 0) if jobs else 0
            if not result["killed"] and total and step >= total // 6:
                with cluster.lock:
                    leader = next(n for n in cluster.pods
                                  if n.startswith("coordinator") and cluster.ready.get(n))
                print(f"step {step}/{total}: kill -9 {leader} and worker-1", flush=True)
                new = cluster.kill(leader, replace=True)
                cluster.kill("worker-1", replace=True)
                result["killed"] = [leader, "worker-1"]
                result["replacement"] = new
            time.sleep(0.5)
        if p.poll() is None:
            raise RuntimeError("the submit Job did not end within 600 s")
        result["submit_exit"] = p.returncode
        # From outside: the CLI on this host, through the forwarded port,
        # with the cluster CA (the coordinator's certificate names
        # localhost) and the submit token, submits a small job and waits.
        vip = cluster.services["coordinator"]
        threading.Thread(target=forward_loop, args=(forward, (vip, 50051)), daemon=True).start()
        small = os.path.join(work, "outside.toml")
        with open(small, "w") as f:
            f.write(OUTSIDE_JOB)
        port = forward.getsockname()[1]
        o = subprocess.run(
            [bins[0], "--coordinator", f"127.0.0.1:{port}",
             "--ca", os.path.join(secrets, "ca.pem"),
             "--token-file", os.path.join(secrets, "submit.token"), "submit", small, "--wait"],
            capture_output=True, text=True, timeout=300, pass_fds=(host_ns,),
            preexec_fn=lambda: setns_fd(host_ns))
        with open(os.path.join(work, "outside.log"), "w") as f:
            f.write(o.stdout + o.stderr)
        result["outside_exit"] = o.returncode
        result["outside_last"] = (o.stdout.strip().splitlines() or [""])[-1]
    finally:
        cluster.stopped = True
        for name in list(net.pods):
            try:
                runner.kill(name)
            except Exception:
                pass
        net.down()
    # The undisturbed run: the same spec, world size and intra-op threads.
    ref = os.path.join(work, "reference")
    os.makedirs(ref)
    with open(os.path.join(ref, "job.toml"), "w") as f:
        f.write(objs.get("ConfigMap", "accrue-job-digits")["data"]["job.toml"])
    os.symlink(os.path.join(runner.shared, "accrue-data", "digits"), os.path.join(ref, "digits"))
    worker = objs.get("StatefulSet", "worker")
    threads = quantity(worker["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"], "1")
    with open(os.path.join(work, "reference.log"), "wb") as log:
        subprocess.run([bins[0], "local", "job.toml", "--workers", str(worker["spec"]["replicas"]),
                        "--threads", threads, "--state-dir", "state"],
                       cwd=ref, check=True, stdout=log, stderr=log)
    ckpt = "checkpoints/digits-mlp-1"
    last = open(os.path.join(ref, "state", ckpt, "LATEST")).read().strip()
    cluster_ckpt = os.path.join(runner.shared, "accrue-checkpoints", ckpt)
    result["cluster_latest"] = open(os.path.join(cluster_ckpt, "LATEST")).read().strip()
    result["reference_latest"] = last
    result["max_abs_diff"] = compare(
        os.path.join(ref, "state", ckpt, last, "model.safetensors"),
        os.path.join(cluster_ckpt, result["cluster_latest"], "model.safetensors"))
    print("result:", json.dumps(result), flush=True)
    ok = (result["submit_exit"] == 0 and len(result["killed"]) == 2
          and result["outside_exit"] == 0
          and result["cluster_latest"] == last and result["max_abs_diff"] == 0.0)
    return 0 if ok else 1


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "run":
        sys.exit(run(sys.argv[2], sys.argv[3], sys.argv[4]))
    sys.exit("usage: cluster_run.py run REPO BIN_DIR WORKDIR")


if __name__ == "__main__":
    main()
