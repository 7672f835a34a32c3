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
      with the engine's model.safetensors (loaded strictly into the module)
"""
import json
import sys

import torch
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
    data = load_file(f"{d}/data.safetensors")
    x, y = data["x"], data["y"]
    model = mlp()
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    kind = cfg.get("optimizer", "sgd")
    if kind == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"], nesterov=cfg.get("nesterov", False))
    else:
        cls = torch.optim.Adam if kind == "adam" else torch.optim.AdamW
        opt = cls(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"], foreach=False)
    sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=cfg["seed"])
    big_batch = cfg["batch"] * cfg["k"]
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order), big_batch):
            idx = torch.tensor(order[start:start + big_batch])
            opt.zero_grad()
            loss_fn(model(x[idx]), y[idx]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=cfg["max_norm"])
            opt.step()
            steps += 1
    engine = mlp()
    engine.load_state_dict(load_file(engine_model), strict=True)
    ref, got = model.state_dict(), engine.state_dict()
    worst = max(((got[k] - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref)
    moved = max(((ref[k] - v).abs().max()).item() for k, v in load_file(f"{d}/init.safetensors").items())
    print(json.dumps({"steps": steps, "max_rel_diff": worst, "max_change_from_init": moved}))


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
    elif cmd == "script-export":
        script_export(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")
