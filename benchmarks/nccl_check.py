"""NCCL smoke check: join an ``nccl`` process group under torchrun and all-reduce a CUDA tensor.

    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/nccl_check.py

Each rank contributes ``rank + 1``; rank 0 prints the versions, the result and whether it is the expected
``world · (world + 1) / 2``. Exits 1 on a wrong sum, 2 without a CUDA device.
"""
from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("nccl_check: no CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    t0 = time.perf_counter()
    dist.init_process_group("nccl", init_method="env://", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1 << 20,), float(rank + 1), device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize(dev)
    got, want = x[0].item(), world * (world + 1) / 2
    ok = bool(torch.all(x == want).item())
    dt = time.perf_counter() - t0
    if rank == 0:
        print(f"nccl_check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, backend {dist.get_backend()}, world {world}, "
              f"device {torch.cuda.get_device_name(dev)}")
        print(f"nccl_check: all_reduce(sum) of 1M floats = {got} (want {want}): {'OK' if ok else 'WRONG'}; "
              f"init + all_reduce {dt:.2f} s")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
