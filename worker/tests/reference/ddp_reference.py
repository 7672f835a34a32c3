"""PyTorch DDP with no_sync on gloo: the independent reference for accrue's
multi-rank runs. Started by torchrun, one process per rank:

  python -m torch.distributed.run --nproc-per-node 2 \
      --master-addr 127.0.0.1 --master-port PORT ddp_reference.py DIR CONFIG_JSON

CONFIG_JSON: the shared settings (seed, batch, k, epochs, max_norm, zero)
and "cases", a list of {tag, optimizer: "sgd" | "adam" | "adamw", lr,
momentum (sgd), weight_decay}. For each case every rank trains
torch_reference.mlp() from DIR/init.safetensors on DIR/data.safetensors as
a DDP user writes it: DistributedSampler(shuffle, seed) with set_epoch, a
DataLoader of micro-batches of b, backward of `cross_entropy(mean) / k`
under ddp.no_sync() for k - 1 micro-batches and outside it for the k-th
(DDP's all-reduce, averaged over W), then clip_grad_norm_, the optimizer
(torch.optim.SGD with momentum and weight decay, Adam (L2 decay) or AdamW;
with "zero" through torch.distributed.optim.ZeroRedundancyOptimizer, which
shards its state over the ranks) and zero_grad. Rank r writes its stdout
and stderr to DIR/ddp-rank<r>.log and its pid to DIR/ddp-rank<r>.pid; per
case its final state_dict (module names) to DIR/ddp-<tag>-rank<r>.safetensors
and each step's total norm (clip_grad_norm_'s return value) with the
optimizer's class names as JSON to DIR/ddp-<tag>-rank<r>.json.
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


OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}


def train(d, cfg, case, world):
    data = load_file(f"{d}/data.safetensors")
    model = mlp()
    model.load_state_dict(load_file(f"{d}/init.safetensors"))
    ddp = DistributedDataParallel(model)
    kind = case["optimizer"]
    args = dict(lr=case["lr"], weight_decay=case["weight_decay"])
    if kind == "sgd":
        args["momentum"] = case["momentum"]
    if cfg.get("zero"):
        # Optimizer state sharded over the ranks (ZeRO stage 1).
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=OPTIMIZERS[kind], **args)
        local = opt.optim
    else:
        opt = OPTIMIZERS[kind](ddp.parameters(), **args)
        local = opt
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
    tag = case["tag"]
    state = {n: t.detach().contiguous() for n, t in model.state_dict().items()}
    save_file(state, os.path.join(d, f"ddp-{tag}-rank{rank}.safetensors"))
    with open(os.path.join(d, f"ddp-{tag}-rank{rank}.json"), "w") as f:
        json.dump({"world": world, "norms": norms, "optimizer": type(opt).__name__,
                   "local_optimizer": type(local).__name__}, f)
    print(f"rank {rank}: {tag}: {len(norms)} steps")


def main(d, cfg):
    cfg = json.loads(cfg)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    for case in cfg["cases"]:
        train(d, cfg, case, world)
    # Every rank past its last collective, then out without tearing the
    # gloo group down: with ZeroRedundancyOptimizer, destroy_process_group
    # (or the interpreter's exit after it) aborted a rank ("terminate
    # called without an active exception", exit -6) on a loaded machine
    # after its results were written. Nothing is left to clean up.
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
