"""PyTorch reference values for accrue's engine tests (run by the Rust tests
with the project's virtual environment).

  torch_reference.py clip-train DIR CONFIGS_JSON OUT_PREFIX
      for each config: trains the e2e MLP from DIR/init.safetensors on
      DIR/data.safetensors with one batch per
      window (the union of what the W ranks read in it, in DistributedSampler
      order), clip_grad_norm_ (norm_type 2 or inf) or clip_grad_value_, SGD
      or Adam; writes OUT_PREFIX<i>.safetensors and prints, as JSON, each
      step's total norm and how often clipping acted
  torch_reference.py sampler
      DistributedSampler index lists for several settings, as JSON
  torch_reference.py e2e-prepare DIR
      data.safetensors (x, y) and init.safetensors (an MLP's state_dict)
  torch_reference.py e2e-compare DIR CHECKPOINT_MODEL STEPS_PER_EPOCH_JSON
      trains the same MLP with one large batch per optimizer step and compares
      with the engine's model.safetensors (loaded strictly into the module);
      cfg "device" ("cpu" by default, "cuda" on a GPU machine) picks where
  torch_reference.py model-check KIND C H W CLASSES FILE
      builds lenet5/resnet18/resnet34 in PyTorch (torchvision's architecture
      and names, written out here: torchvision is not installed), loads
      accrue's initial weights from FILE strictly, runs the same training
      forward, backward and eval forward, and prints the differences from
      accrue's outputs, gradients and BatchNorm statistics as JSON
  torch_reference.py cifar-train DIR CFG_JSON
      decodes DIR's CIFAR-10 binary batches by the format's definition
      (records of a label byte and 3x32x32 channel-major pixels), compares
      with accrue's decoding (DIR/accrue_decoded.safetensors), trains LeNet-5
      from DIR/init.safetensors with one large batch per step in
      DistributedSampler order, evaluates on test_batch.bin and compares
      with the engine's final DIR/model.safetensors; prints JSON
  torch_reference.py adam-steps DIR CFG_JSON
      DIR/start.safetensors holds parameters p.<i> and per-step gradients
      g.<step>.<i>; takes len(cfg lrs) steps of torch.optim.Adam or AdamW
      (cfg kind, weight_decay, fused) on cfg device with those gradients
      and learning rates, and prints, as JSON, how many elements of the
      parameters and moments differ from accrue's DIR/accrue.safetensors
      and the largest difference
  torch_reference.py schedules CONFIGS_JSON
      the learning rate of every optimizer step under torch.optim.lr_scheduler
      for each config (kind, lr, warmup, total, step_size, gamma, min_lr)
"""
import json
import os
import sys

# Deterministic cuBLAS on CUDA (use_deterministic_algorithms requires it);
# read when the first cuBLAS handle is made, harmless on CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file, save_file
from torch.utils.data import DistributedSampler

torch.use_deterministic_algorithms(True)


def sampler():
    cases = []
    for n, world, seed, epoch, shuffle, drop_last in [
        (10, 3, 0, 0, False, False),
        (10, 3, 42, 1, True, False),
        (10, 3, 42, 1, True, True),
        (100, 4, 7, 3, True, False),
        (1000, 1, 123, 0, True, False),
        (37, 5, 2**33 + 5, 2, True, True),
    ]:
        ranks = []
        for rank in range(world):
            s = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
            s.set_epoch(epoch)
            ranks.append(list(s))
        cases.append(dict(n=n, world=world, seed=seed, epoch=epoch, shuffle=shuffle, drop_last=drop_last, ranks=ranks))
    print(json.dumps(cases))


def step_indices(n, cfg):
    """Each optimizer step's sample indices over cfg["epochs"] epochs: one
    rank's DistributedSampler order (shuffled with cfg["seed"]), cut into
    steps of cfg["batch"] * cfg["k"] samples (the last of an epoch short)."""
    sampler = DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=cfg["seed"])
    big_batch = cfg["batch"] * cfg["k"]
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), big_batch):
            yield torch.tensor(order[start:start + big_batch])


N, FEATURES, HIDDEN, CLASSES = 100, 6, [16, 12], 4


def mlp():
    widths = [FEATURES] + HIDDEN + [CLASSES]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def e2e_prepare(d):
    torch.manual_seed(3)
    x = torch.randn(N, FEATURES)
    y = torch.randint(0, CLASSES, (N,))
    save_file({"x": x, "y": y}, f"{d}/data.safetensors")
    save_file({k: v.contiguous() for k, v in mlp().state_dict().items()}, f"{d}/init.safetensors")


def e2e_compare(d, engine_model, cfg):
    cfg = json.loads(cfg)
    dev = torch.device(cfg.get("device", "cpu"))
    data = load_file(f"{d}/data.safetensors", device=str(dev))
    x, y = data["x"], data["y"]
    model = mlp().to(dev)
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    kind = cfg.get("optimizer", "sgd")
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"], nesterov=cfg.get("nesterov", False))
    else:
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        # fused: PyTorch's fused kernel (`fused=True`), else its for-loop one.
        fused = cfg.get("fused", False)
        opt = cls(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"],
                  foreach=None if fused else False, fused=fused or None)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for idx in step_indices(N, cfg):
        opt.zero_grad()
        loss_fn(model(x[idx]), y[idx]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg["max_norm"])
        opt.step()
        steps += 1
    engine = mlp().to(dev)
    engine.load_state_dict(load_file(engine_model), strict=True)
    ref, got = model.state_dict(), engine.state_dict()
    per_key = {k: ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
    worst = max(per_key.values())
    moved = max(((ref[k] - v).abs().max()).item() for k, v in load_file(f"{d}/init.safetensors", device=str(dev)).items())
    print(json.dumps({"steps": steps, "device": str(dev), "max_rel_diff": worst, "max_change_from_init": moved}))


class LeNet5(nn.Module):
    """docs/SEMANTICS.md's LeNet-5: conv1 pads by 2, ReLU, max-pooling."""

    def __init__(self, c, h, w, classes):
        super().__init__()
        side = lambda s: (s // 2 - 4) // 2
        self.conv1 = nn.Conv2d(c, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * side(h) * side(w), 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class BasicBlock(nn.Module):
    """torchvision.models.resnet.BasicBlock (expansion 1)."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision.models.resnet.ResNet with BasicBlock: resnet18 is
    [2, 2, 2, 2], resnet34 [3, 4, 6, 3]."""

    def __init__(self, blocks, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = 64
        for i, (cout, n) in enumerate(zip([64, 128, 256, 512], blocks)):
            stride = 1 if i == 0 else 2
            layer = [BasicBlock(cin, cout, stride)] + [BasicBlock(cout, cout, 1) for _ in range(n - 1)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*layer))
            cin = cout
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build(kind, c, h, w, classes):
    if kind == "lenet5":
        return LeNet5(c, h, w, classes)
    return ResNet({"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3]}[kind], classes)


def model_check(kind, c, h, w, classes, path):
    """FILE holds accrue's `init.<name>` (parameters and buffers before the
    forward), `x`, `y`, and what accrue computed: `out.logits` (training
    forward), `grad.<param>` (of the summed cross-entropy), `after.<buffer>`
    (BatchNorm statistics after that forward) and `out.eval_logits` (eval
    forward afterwards). One intra-op thread, as the Rust side: the same
    kernels then sum in the same order."""
    torch.set_num_threads(1)
    t = load_file(path)
    model = build(kind, c, h, w, classes)
    init = {k[len("init."):]: v for k, v in t.items() if k.startswith("init.")}
    model.load_state_dict(init, strict=True)
    model.train()
    logits = model(t["x"])
    F.cross_entropy(logits, t["y"], reduction="sum").backward()
    with torch.no_grad():
        model.eval()
        eval_logits = model(t["x"])
    diffs = {}

    def cmp(key, ref):
        got = t[key]
        assert got.shape == ref.shape, f"{key}: accrue {tuple(got.shape)}, pytorch {tuple(ref.shape)}"
        diffs[key] = [(got - ref).abs().max().item(), ref.abs().max().item()]

    cmp("out.logits", logits.detach())
    cmp("out.eval_logits", eval_logits)
    for n, p in model.named_parameters():
        cmp(f"grad.{n}", p.grad)
    buffers = [(n, b) for n, b in model.named_buffers() if not n.endswith("num_batches_tracked")]
    for n, b in buffers:
        cmp(f"after.{n}", b)
    print(json.dumps({
        "params": [[n, list(p.shape)] for n, p in model.named_parameters()],
        "buffers": [[n, list(b.shape)] for n, b in buffers],
        "diffs": diffs,
    }))


CIFAR_TRAIN = [f"data_batch_{i}.bin" for i in range(1, 6)]


def cifar_decode(d, files):
    """The CIFAR-10 binary format: 3,073-byte records, the label byte then
    1,024 red, 1,024 green and 1,024 blue bytes, each plane row-major."""
    xs, ys = [], []
    for f in files:
        with open(f"{d}/{f}", "rb") as fh:
            raw = fh.read()
        assert len(raw) % 3073 == 0, f"{f}: {len(raw)} bytes"
        rec = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, 3073)
        ys.append(rec[:, 0].long())
        xs.append(rec[:, 1:].reshape(-1, 3, 32, 32).float() / 255.0)
    return torch.cat(xs), torch.cat(ys)


def cifar_train(d, cfg):
    cfg = json.loads(cfg)
    torch.set_num_threads(1)
    x, y = cifar_decode(d, CIFAR_TRAIN)
    tx, ty = cifar_decode(d, ["test_batch.bin"])
    ours = load_file(f"{d}/accrue_decoded.safetensors")
    decoded = {
        "train_x_max_abs_diff": (ours["train.x"] - x).abs().max().item(),
        "test_x_max_abs_diff": (ours["test.x"] - tx).abs().max().item(),
        "train_y_equal": torch.equal(ours["train.y"], y),
        "test_y_equal": torch.equal(ours["test.y"], ty),
        "train_len": len(y),
        "test_len": len(ty),
    }
    def train(micro):
        """The loop with each step's batch in micro-batches of `micro`
        rows, their summed losses over the batch's rows (another valid
        order of the same sums when micro < the batch)."""
        model = LeNet5(3, 32, 32, 10)
        model.load_state_dict(load_file(f"{d}/init.safetensors"), strict=True)
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
        losses = []
        for idx in step_indices(len(y), cfg):
            opt.zero_grad()
            if micro >= len(idx):
                loss = F.cross_entropy(model(x[idx]), y[idx])
                loss.backward()
            else:
                loss = 0.0
                for m in idx.split(micro):
                    part = F.cross_entropy(model(x[m]), y[m], reduction="sum") / len(idx)
                    part.backward()
                    loss += part.item()
                loss = torch.tensor(loss)
            losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg["max_norm"])
            opt.step()
        return model, losses

    def rel_diff(a, b):
        a, b = a.state_dict(), b.state_dict()
        return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)

    model, losses = train(cfg["batch"] * cfg["k"])
    # PyTorch's own floor: the same loop in micro-batches of `batch`.
    other, _ = train(cfg["batch"])
    floor = rel_diff(other, model)
    with torch.no_grad():
        logits = model(tx)
        eval_loss = F.cross_entropy(logits, ty).item()
        eval_accuracy = (logits.argmax(1) == ty).float().mean().item()
    engine = LeNet5(3, 32, 32, 10)
    engine.load_state_dict(load_file(f"{d}/model.safetensors"), strict=True)
    ref, got = model.state_dict(), engine.state_dict()
    per_key = {k: ((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
    worst = max(per_key.values())
    print(json.dumps({"decoded": decoded, "losses": losses, "eval_loss": eval_loss, "eval_accuracy": eval_accuracy, "max_rel_diff": worst, "per_tensor": per_key, "floor": floor}))


def schedules(cfgs):
    """docs/SEMANTICS.md's schedules as torch.optim.lr_scheduler objects:
    warm-up w is LinearLR(1/w -> 1 over w - 1 steps) (LambdaLR of (s+1)/w
    when w = 1: LinearLR cannot span 0 steps), followed at milestone w by
    StepLR, CosineAnnealingLR(T_max = total - w, eta_min = min_lr) or nothing
    (constant, linear_warmup) through SequentialLR. The rate of optimizer
    step s is the group's lr after s scheduler.step() calls."""
    from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, SequentialLR, StepLR

    out = []
    for c in json.loads(cfgs):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=c["lr"])
        w, total, kind = c["warmup"], c["total"], c["kind"]
        if kind == "cosine":
            main = CosineAnnealingLR(opt, T_max=total - w, eta_min=c.get("min_lr", 0.0))
        elif kind == "step":
            main = StepLR(opt, step_size=c["step_size"], gamma=c.get("gamma", 0.1))
        else:
            main = LambdaLR(opt, lambda s: 1.0)
        if w == 0:
            sched = main
        else:
            if w == 1:
                warm = LambdaLR(opt, lambda s: (s + 1) / w)
            else:
                warm = LinearLR(opt, start_factor=1 / w, end_factor=1.0, total_iters=w - 1)
            sched = SequentialLR(opt, [warm, main], milestones=[w])
        lrs = []
        for _ in range(total):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        out.append(lrs)
    print(json.dumps(out))


def windows(n, world, k, b, seed, epoch):
    """The samples of each window of `epoch`, as the engine's W ranks read
    them: rank r takes DistributedSampler(rank=r)'s list in micro-batches of
    b consecutive indices; a window is k micro-batches of every rank (the
    epoch's last may be shorter)."""
    lists = []
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=True, seed=seed)
        s.set_epoch(epoch)
        lists.append(list(s))
    micro = -(-max(len(l) for l in lists) // b)
    for m in range(0, micro, k):
        yield [i for l in lists for i in l[m * b:(m + k) * b]]


def clip_train(d, cfgs, out_prefix):
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]
    results = []
    for i, cfg in enumerate(json.loads(cfgs)):
        model = mlp()
        model.load_state_dict(load_file(f"{d}/init.safetensors"))
        params = list(model.parameters())
        if cfg["optimizer"] == "sgd":
            opt = torch.optim.SGD(params, lr=cfg["lr"], momentum=0.9, weight_decay=0.01, foreach=False)
        else:
            opt = torch.optim.Adam(params, lr=cfg["lr"], weight_decay=0.01, foreach=False)
        norms, clipped, clamped = [], 0, 0
        for epoch in range(cfg["epochs"]):
            for idx in windows(len(y), cfg["world"], cfg["k"], cfg["batch"], cfg["seed"], epoch):
                idx = torch.tensor(idx)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
                if "max_norm" in cfg:
                    norm_type = float(cfg["norm_type"])
                    total = torch.nn.utils.clip_grad_norm_(params, max_norm=cfg["max_norm"], norm_type=norm_type)
                    clipped += int(total.item() > cfg["max_norm"])
                else:
                    # The engine reports the 2-norm before clip_grad_value_.
                    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
                    clamped += sum(int((p.grad.abs() > cfg["clip_value"]).sum()) for p in params)
                    torch.nn.utils.clip_grad_value_(params, clip_value=cfg["clip_value"])
                norms.append(total.item())
                opt.step()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, f"{out_prefix}{i}.safetensors")
        results.append({"norms": norms, "clipped_steps": clipped, "clamped_elements": clamped})
    print(json.dumps(results))


def script_export(d):
    """A TorchScript twin of the e2e MLP and its weights as safetensors."""
    torch.manual_seed(4)
    m = mlp()
    torch.jit.script(m).save(f"{d}/model.pt")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, f"{d}/script_init.safetensors")


def adam_steps(d, cfg):
    cfg = json.loads(cfg)
    dev = torch.device(cfg["device"])
    start = load_file(f"{d}/start.safetensors", device=str(dev))
    n = sum(1 for k in start if k.startswith("p."))
    params = [start[f"p.{i}"].clone() for i in range(n)]
    cls = torch.optim.Adam if cfg["kind"] == "adam" else torch.optim.AdamW
    fused = cfg["fused"]
    opt = cls(params, lr=cfg["lrs"][0], weight_decay=cfg["weight_decay"],
              foreach=None if fused else False, fused=fused or None)
    for step, lr in enumerate(cfg["lrs"]):
        for group in opt.param_groups:
            group["lr"] = lr
        for i, p in enumerate(params):
            p.grad = start[f"g.{step}.{i}"].clone()
        opt.step()
    ours = load_file(f"{d}/accrue.safetensors", device=str(dev))
    differ, worst = 0, 0.0
    for i, p in enumerate(params):
        st = opt.state[p]
        for name, t in [("p", p), ("exp_avg", st["exp_avg"]), ("exp_avg_sq", st["exp_avg_sq"])]:
            o = ours[f"{name}.{i}"]
            differ += int((o != t).sum())
            worst = max(worst, float((o - t).abs().max()))
    print(json.dumps({"differ": differ, "max_abs_diff": worst, "device": str(params[0].device)}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "clip-train":
        clip_train(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "sampler":
        sampler()
    elif cmd == "e2e-prepare":
        e2e_prepare(sys.argv[2])
    elif cmd == "e2e-compare":
        e2e_compare(sys.argv[2], sys.argv[3], sys.argv[4])
    elif cmd == "model-check":
        model_check(sys.argv[2], *map(int, sys.argv[3:7]), sys.argv[7])
    elif cmd == "cifar-train":
        cifar_train(sys.argv[2], sys.argv[3])
    elif cmd == "adam-steps":
        adam_steps(sys.argv[2], sys.argv[3])
    elif cmd == "schedules":
        schedules(sys.argv[2])
    elif cmd == "script-export":
        script_export(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")
