"""PyTorch's own mixed-precision loop: the independent reference
for accrue's `precision = "bf16" | "fp16"` (issue 18). Started by torchrun,
one process per rank (W = 1 too):

  python -m torch.distributed.run --nproc-per-node W \
      --master-addr 127.0.0.1 --master-port PORT amp_reference.py DIR CONFIG_JSON

CONFIG_JSON: the shared settings (lr, momentum, weight_decay, seed, batch,
epochs, max_norm, device: "cpu" (the default) or "cuda") and "cases", a list of {tag, precision, k, data,
init_scale, growth_interval; optionally model: "mlp" (the default),
"lenet5" or "resnet18" with shape [C, H, W] and classes, init (default
init.safetensors), epochs, lr, max_norm}. For each case every rank trains
torch_reference.mlp() (or torch_reference.build(model, ...)) from
DIR/<init> on DIR/<data> as a user of
torch.autocast and GradScaler writes it: DDP on gloo with no_sync for the
first k - 1 micro-batches of a window, the forward and the loss under
`torch.autocast(device, dtype)`, `scaler.scale(loss / k).backward()`; at
the window's end `scaler.unscale_(opt)`, clip_grad_norm_,
`scaler.step(opt)`, `scaler.update()` (the scaler disabled for bf16, as
one uses it) and zero_grad. Rank r writes its log to
DIR/amp-rank<r>.log; per case rank 0 writes the final state_dict (with
BatchNorm's running statistics) to
DIR/amp-<tag>.safetensors and, to DIR/amp-<tag>.json, every step's scale
(the one its gradients had; 0 for bf16), whether the step was skipped (the
scale backed off) and clip_grad_norm_'s total norm.
"""
import contextlib
import datetime
import json
import math
import os
import sys

rank = int(os.environ["RANK"])
out_dir = sys.argv[1]
log = open(os.path.join(out_dir, f"amp-rank{rank}.log"), "w")
os.dup2(log.fileno(), 1)
os.dup2(log.fileno(), 2)
with open(os.path.join(out_dir, f"amp-rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import build, mlp  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def train(d, cfg, case, world):
    dev = cfg.get("device", "cpu")
    data = load_file(os.path.join(d, case["data"]))
    kind = case.get("model", "mlp")
    model = mlp() if kind == "mlp" else build(kind, *case["shape"], case["classes"])
    # accrue's files hold no num_batches_tracked: BatchNorm fills it in.
    model.load_state_dict(load_file(os.path.join(d, case.get("init", "init.safetensors"))))
    model.to(dev)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=case.get("lr", cfg["lr"]), momentum=cfg["momentum"],
                          weight_decay=cfg["weight_decay"])
    fp16 = case["precision"] == "fp16"
    scaler = torch.amp.GradScaler(dev, init_scale=case.get("init_scale", 65536.0),
                                  growth_interval=case.get("growth_interval", 2000), enabled=fp16)
    dataset = TensorDataset(data["x"], data["y"])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_size=cfg["batch"], sampler=sampler)
    k = case["k"]
    steps = []
    for epoch in range(case.get("epochs", cfg["epochs"])):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(dev), y.to(dev)
            sync = (i + 1) % k == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if sync else ddp.no_sync():
                with torch.autocast(dev, dtype=DTYPES[case["precision"]]):
                    loss = torch.nn.functional.cross_entropy(ddp(x), y)
                scaler.scale(loss / k).backward()
            if sync:
                scale = scaler.get_scale() if fp16 else 0.0
                scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=case.get("max_norm", cfg["max_norm"]))
                scaler.step(opt)
                scaler.update()
                skipped = fp16 and scaler.get_scale() < scale
                opt.zero_grad()
                n = norm.item()
                # JSON has no NaN or infinity: a non-finite norm is null.
                steps.append({"scale": scale, "skipped": skipped, "norm": n if math.isfinite(n) else None})
    if rank == 0:
        state = {n: t.detach().cpu().contiguous() for n, t in model.state_dict().items()}
        save_file(state, os.path.join(d, f"amp-{case['tag']}.safetensors"))
        with open(os.path.join(d, f"amp-{case['tag']}.json"), "w") as f:
            json.dump({"world": world, "steps": steps}, f)
    print(f"rank {rank}: {case['tag']}: {len(steps)} steps, {sum(s['skipped'] for s in steps)} skipped")


def main(d, cfg):
    cfg = json.loads(cfg)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    for case in cfg["cases"]:
        train(d, cfg, case, world)
    # Every rank past its last collective, then out without tearing the
    # gloo group down (see ddp_reference.py).
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
