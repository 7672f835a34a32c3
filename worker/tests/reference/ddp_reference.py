"""PyTorch DDP with no_sync on gloo: the independent reference for accrue's
multi-rank runs. Started by torchrun, one process per rank:

  python -m torch.distributed.run --nproc-per-node 2 \
      --master-addr 127.0.0.1 --master-port PORT ddp_reference.py DIR CONFIG_JSON

Every rank trains torch_reference.mlp() from DIR/init.safetensors on
DIR/data.safetensors as a DDP user writes it: DistributedSampler(shuffle,
seed) with set_epoch, a DataLoader of micro-batches of b, backward of
`cross_entropy(mean) / k` under ddp.no_sync() for k - 1 micro-batches and
outside it for the k-th (DDP's all-reduce, averaged over W), then
clip_grad_norm_, SGD (momentum, weight decay; with "zero" in the config
through ZeroRedundancyOptimizer, which shards its state) and zero_grad.
Rank r writes
its stdout and stderr to DIR/ddp-rank<r>.log, its pid to
DIR/ddp-rank<r>.pid, its final state_dict (module names) to
DIR/ddp-rank<r>.safetensors and each step's total norm (clip_grad_norm_'s
return value) as JSON to DIR/ddp-rank<r>.json.
"""
import contextlib
import datetime
import json
import os
import sys

rank = int(os.environ["RANK"])
out_dir = sys.argv[1]
log = open(os.path.join(out_dir, f"ddp-rank{rank}.log"), "w")
os.dup2(log.fileno(), 1)
os.dup2(log.fileno(), 2)
with open(os.path.join(out_dir, f"ddp-rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import mlp  # noqa: E402


def main(d, cfg):
    cfg = json.loads(cfg)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    data = load_file(f"{d}/data.safetensors")
    model = mlp()
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    ddp = DistributedDataParallel(model)
    sgd = dict(lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    if cfg.get("zero"):
        # Optimizer state sharded over the ranks (ZeRO stage 1).
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, **sgd)
    else:
        opt = torch.optim.SGD(ddp.parameters(), **sgd)
    dataset = TensorDataset(data["x"], data["y"])
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg["seed"])
    loader = DataLoader(dataset, batch_size=cfg["batch"], sampler=sampler)
    k = cfg["k"]
    norms = []
    for epoch in range(cfg["epochs"]):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % k == 0 or i + 1 == len(loader)
            with contextlib.nullcontext() if sync else ddp.no_sync():
                (torch.nn.functional.cross_entropy(ddp(x), y) / k).backward()
            if sync:
                norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=cfg["max_norm"])
                norms.append(norm.item())
                opt.step()
                opt.zero_grad()
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, os.path.join(d, f"ddp-rank{rank}.safetensors"))
    with open(os.path.join(d, f"ddp-rank{rank}.json"), "w") as f:
        json.dump({"world": world, "norms": norms, "optimizer": type(opt).__name__}, f)
    dist.destroy_process_group()
    print(f"rank {rank}: {len(norms)} steps")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
