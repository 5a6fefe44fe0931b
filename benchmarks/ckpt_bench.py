"""Checkpointing: save stall, promotion throughput and goodput, each beside its anchor, in one run.

1. **Stall** for models of ≈ 10 M, 100 M and 350 M params (fp32 weights + AdamW moments, one gloo rank on
   this machine): the anchor is a *synchronous* save (``checkpoint.async_mode=sync``: DCP write, hashing,
   COMMIT, all while training waits); ours is the async save's stall (``thread``: training waits only while the
   state is copied into reused host buffers). Ratio = stall ÷ sync save (target ≤ 0.25).
2. **Promotion** of the 100 M checkpoint L0 → L1 → L2 (``ckpt_tiers.promote``: copy, sha256 of every file,
   S3 upload with SHA-256 checksums verified, COMMIT last) against a plain ``shutil.copyfile`` + boto3
   ``upload_file`` of the same bytes with the same transfer settings (no checksums). Ratio = our MB/s ÷ plain
   MB/s (target ≥ 0.8), best of two alternated runs each. L2 is the embedded S3 endpoint (rclone serve s3 on 127.0.0.1).
3. **Goodput**: wall-clock tokens/s of a 2-rank demo-model run (``pipelines.train.launch``; promotion to L1 and
   L2 during the run) that checkpoints at
   the Young/Daly interval (``train.ckpt_every=auto``, ``checkpoint.mtbf_hours`` = 1 h per node, pessimistic),
   and every 10 steps, against the same run with no checkpoint but the final one. Ratio = with ÷ without
   (target ≥ 0.97); each configuration ``--repeats`` times, interleaved, the median reported.

4. **Two nodes** (simulated: each a mount namespace with its own disk at ``checkpoint.l0``, one rank each,
   ``pipelines.sim_nodes``) on a ≈ 14 M-param model: the save stall and the time to a global commit on L1 (L2 follows in its own thread)
   with node-local L0, against L0 on the shared directory (target: node-local stall ≤ shared stall); then the
   restore on a replacement node, from L1 (the surviving node keeps its disk) and from L2 (L1 removed, every
   node downloads its own part in parallel), against one rank fetching the whole checkpoint (target: parallel L2
   restore ≥ 1.6× the single-rank one).

    python benchmarks/ckpt_bench.py [--tokenize-manifest M] [--steps 150] [--sizes 10m,100m,350m] [--only nodes]
    python benchmarks/ckpt_bench.py --only stall [--sizes 10m,100m,350m] [--device cuda] [--out PATH]
    python -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/ckpt_bench.py --only stall \
        --device cuda --backend nccl   # the stall with an NCCL default process group, as the trainer runs on GPUs

Writes ``var/bench/ckpt.json`` (``--only nodes``: ``ckpt-nodes.json``; ``--only stall``: ``ckpt-stall.json``,
or ``--out``). ``--only stall`` runs part 1 alone (no tokenize manifest needed); with ``--device cuda`` the
model and its AdamW state live on the GPU, so the async save's stall is the copy into pinned host buffers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"10m": dict(d_model=256, n_layers=4, n_heads=4), "100m": dict(d_model=768, n_layers=12, n_heads=12),
         "350m": dict(d_model=1024, n_layers=24, n_heads=16)}
VOCAB = 32000


def _model_and_opt(size: str, device: str = "cpu"):
    import torch

    from pipelines.train.model import ModelArgs, Transformer

    with torch.device(device):  # on a GPU: built there, no CPU init and no copy
        model = Transformer(ModelArgs(vocab_size=VOCAB, seq_len=256, **SIZES[size]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()  # real AdamW state (two moments per parameter), on the model's device
    return model, opt


def _sync(device: str) -> None:
    """Queued GPU work (the optimizer step) done before a timed save: the stall is the save's own."""
    if device != "cpu":
        import torch

        torch.cuda.synchronize()


def stall_rows(sizes: list[str], base: Path, device: str = "cpu") -> tuple[list[dict], Path]:
    from pipelines.spec import load_spec
    from pipelines.train.ckpt.checkpointer import Checkpointer
    from pipelines.train.model import param_count

    rows, keep = [], None
    for size in sizes:
        model, opt = _model_and_opt(size, device)
        row = {"model": size, "params": param_count(model.args)}
        for mode in ("sync", "thread"):
            spec = load_spec(None, [f"checkpoint.l0={base}/l0", f"checkpoint.l1={base}/l1", f"checkpoint.async_mode={mode}",
                                    "checkpoint.promote_during_run=false"], env={})
            saver = Checkpointer(spec, f"{size}-{mode}", 0, 1, lambda m: None,
                                 files={"model_args.json": json.dumps(model.args.to_dict()).encode()})
            _sync(device)
            saver.save(1, model, opt, {"step": 1})  # warm-up: staging buffers allocated, pages touched
            saver.wait()
            _sync(device)
            t0 = time.perf_counter()
            stall = saver.save(2, model, opt, {"step": 2})
            saver.wait()
            total = time.perf_counter() - t0
            row[mode] = {"stall_s": round(stall, 4), "save_s": round(total, 4)}
            saver.close(None)
        row["bytes"] = sum(f.stat().st_size for f in (base / "l0" / f"{size}-thread" / "step-000002").iterdir())
        row["ratio"] = round(row["thread"]["stall_s"] / row["sync"]["save_s"], 4)
        rows.append(row)
        print(f"  {size}: sync save {row['sync']['save_s']:.2f} s, async stall {row['thread']['stall_s']:.3f} s "
              f"(ratio {row['ratio']:.3f}), {row['bytes'] / 1e9:.2f} GB", flush=True)
        if size == "100m" or keep is None:
            keep = base / "l0" / f"{size}-thread" / "step-000002"
        if device != "cpu":
            import torch

            del model, opt
            torch.cuda.empty_cache()
    return rows, keep


def print_stalls(stalls: list[dict]) -> None:
    print("\n| checkpoint | params | bytes | sync save (anchor) | async stall (ours) | stall ÷ sync |")
    print("|---|---|---|---|---|---|")
    for r in stalls:
        print(f"| {r['model']} | {r['params'] / 1e6:,.1f} M | {r['bytes'] / 1e9:.2f} GB | {r['sync']['save_s']:.2f} s | "
              f"{r['thread']['stall_s']:.3f} s | {r['ratio']:.3f} |")


def only_stall(args) -> int:
    """Part 1 alone, on ``--device``; with ``--backend nccl`` (under torchrun) the default process group is NCCL,
    as in a GPU training run (the Checkpointer's own writer group is gloo either way)."""
    import torch
    import torch.distributed as dist

    from pipelines.manifest import atomic_write_text

    if args.device == "cuda" and not torch.cuda.is_available():
        print("ckpt_bench: --device cuda but no CUDA device here", file=sys.stderr)
        return 2
    if args.backend == "nccl" and args.device != "cuda":
        print("ckpt_bench: --backend nccl needs --device cuda", file=sys.stderr)
        return 2
    torch.set_num_threads(2)  # as in the full run: its stall rows are measured the same way
    base = ROOT / "var" / "bench" / "ckpt-sizes"
    shutil.rmtree(base, ignore_errors=True)
    check = None
    torchrun = "MASTER_ADDR" in os.environ  # its agent's store: a tcp:// init of our own would wait for it forever
    if args.backend == "nccl":  # RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK from torchrun's env
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", init_method="env://", device_id=dev)
        t = torch.full((4,), float(dist.get_rank() + 1), device=dev)
        dist.all_reduce(t)
        check = {"world_size": dist.get_world_size(), "all_reduce": t.tolist(),
                 "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
        print(f"  nccl default group: world {check['world_size']}, all_reduce {check['all_reduce']}, "
              f"NCCL {check['nccl']}", flush=True)
    elif torchrun:
        dist.init_process_group("gloo", init_method="env://")
    else:
        port = 29500 + os.getpid() % 1000
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        stalls, _ = stall_rows(args.sizes.split(","), base, args.device)
        rank = dist.get_rank()
    finally:
        dist.destroy_process_group()
    shutil.rmtree(base, ignore_errors=True)
    if rank != 0:
        return 0
    result = {"stall": stalls, "device": args.device, "backend": args.backend, "nccl_check": check,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__,
              "machine": {"cpus": os.cpu_count()}}
    print_stalls(stalls)
    out = args.out or str(ROOT / "var" / "bench" / "ckpt-stall.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(result, indent=2))
    print(f"written {out}")
    return 0


def _empty(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for o in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=o["Key"])


def promotion_row(ckpt: Path, base: Path, url: str) -> dict:
    from pipelines.spec import load_spec
    from pipelines.storage import s3
    from pipelines.train.ckpt import local as ckpt_local
    from pipelines.train.ckpt import s3_tier as ckpt_s3
    from pipelines.train.ckpt import tiers as ckpt_tiers

    spec = load_spec(None, [f"checkpoint.l0={base}/l0", f"checkpoint.l1={base}/l1", f"services.s3_endpoint_url={url}",
                            "services.s3_bucket=bench-ckpt"], env={})
    rel = ckpt.relative_to(base / "l0").as_posix()
    nbytes = sum(f.stat().st_size for f in ckpt.iterdir())
    client = s3.client(spec)
    s3.ensure_bucket(client, "bench-ckpt")
    plain = base / "plain-l1"
    ours, anchor = [], []
    for _ in range(2):  # alternated, best of two each: page cache and the endpoint's state favour neither
        ckpt_local.remove_local(Path(ckpt_tiers.tier_locations(spec, rel)["L1"]))
        _empty(client, "bench-ckpt")
        t0 = time.perf_counter()
        rep = ckpt_tiers.promote(spec, rel)
        ours.append(time.perf_counter() - t0)
        _empty(client, "bench-ckpt")
        t0 = time.perf_counter()
        for f in ckpt.iterdir():
            plain.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, plain / f.name)
            client.upload_file(str(plain / f.name), "bench-ckpt", f"plain/{f.name}",
                               Config=ckpt_s3.transfer_config(spec))
        anchor.append(time.perf_counter() - t0)
    _empty(client, "bench-ckpt")  # keep var/s3/store small
    ours, anchor = min(ours), min(anchor)
    row = {"bytes": nbytes, "actions": rep["actions"], "ours_s": round(ours, 3), "plain_s": round(anchor, 3),
           "ours_MBps": round(nbytes / ours / 1e6, 1), "plain_MBps": round(nbytes / anchor / 1e6, 1),
           "ratio": round(anchor / ours, 3)}
    print(f"  promotion: ours {row['ours_MBps']} MB/s, plain {row['plain_MBps']} MB/s (ratio {row['ratio']})", flush=True)
    return row


def goodput_rows(tok_path: str, steps: int, url: str, repeats: int) -> list[dict]:
    """Each configuration ``repeats`` times, interleaved (the 2 cores are shared: one run's noise is ±10 %);
    the median run counts."""
    from pipelines.manifest import load_manifest
    from pipelines.spec import load_spec
    from pipelines.train import launch

    tok = load_manifest(tok_path)
    base = [f"train.steps={steps}", "run.root=var/bench/ckpt-runs", "run.force=true", "train.resume=never",
            "launcher.nproc_per_node=2", "checkpoint.l0=var/bench/ckpt-runs/l0", "checkpoint.l1=var/bench/ckpt-runs/l1",
            f"services.s3_endpoint_url={url}", "services.s3_bucket=bench-goodput"]
    configs = [("no checkpoint until the end", [f"train.ckpt_every={steps}"]),
               ("Young/Daly (ckpt_every=auto, MTBF 1 h/node)", ["train.ckpt_every=auto", "checkpoint.mtbf_hours=1"]),
               ("every 10 steps", ["train.ckpt_every=10"])]
    runs: dict[str, list[dict]] = {label: [] for label, _ in configs}
    for _ in range(repeats):
        for label, extra in configs:
            m = launch.run(load_spec(str(ROOT / "configs" / "demo.yaml"), base + extra, env={}), tok)
            res = json.loads(m.output("result").read_text())
            runs[label].append({"tokens_per_s": res["goodput_tokens_per_s"], "saves": res["ckpt"]["saves"],
                                "stall_s_mean": res["ckpt"]["stall_s_mean"]})
            print(f"  goodput, {label}: {res['goodput_tokens_per_s']:,.0f} tokens/s ({res['ckpt']['saves']} saves)",
                  flush=True)
    rows = []
    for label, rs in runs.items():
        med = sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]
        rows.append({"run": label, "goodput_tokens_per_s": round(med["tokens_per_s"], 1), "saves": med["saves"],
                     "stall_s_mean": med["stall_s_mean"], "all_tokens_per_s": [round(r["tokens_per_s"]) for r in rs]})
    for r in rows:
        r["ratio"] = round(r["goodput_tokens_per_s"] / rows[0]["goodput_tokens_per_s"], 4)
    return rows


NODE_MODEL = ["model.d_model=384", "model.n_layers=6", "model.n_heads=6", "train.micro_batch=4",
              "launcher.nproc_per_node=1", "launcher.nnodes=2", "train.ckpt_every=10"]


RUN = f"{os.getpid()}-{int(time.time())}"  # this invocation's L2 prefix: the embedded store outlives runs


def _two_node_job(tok: str, base: Path, url: str, l0: Path, disks: list[Path], steps: int, prefix: str) -> dict:
    """One 2-node training job on simulated nodes (torchrun with c10d rendezvous on 127.0.0.1); its result.json."""
    from pipelines.sim_nodes import Node
    from pipelines.spec import load_spec

    shared, out = base / "shared", base / "shared" / f"out-{prefix}"
    spec = load_spec(str(ROOT / "configs" / "demo.yaml"), NODE_MODEL + [
        f"train.steps={steps}", f"checkpoint.l0={l0}", f"checkpoint.l1={shared}/l1-{prefix}", f"run.root={shared}/root",
        f"services.s3_endpoint_url={url}", "services.s3_bucket=bench-nodes", f"checkpoint.l2_prefix={RUN}/{prefix}"],
        env={})
    shared.mkdir(parents=True, exist_ok=True)
    (shared / "spec.yaml").write_text(spec.to_yaml())
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "LLMP_PROGRESS": "0", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = []
    for rank, disk in enumerate(disks):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--rdzv-id", prefix, "-m", "pipelines.train.trainer", "--spec", str(shared / "spec.yaml"),
               "--tokenize-manifest", tok, "--out", str(out), "--ckpt-root", str(l0 / "run" / "key")]
        nodes.append(Node(str(rank), disk, base / "l0", cmd, env, base / f"{prefix}-node{rank}.log",
                          restart_on_failure=False, cwd=ROOT))
    for n in nodes:
        if n.wait(1800) != 0:
            raise RuntimeError(f"2-node job {prefix} failed; see {n.log}")
    return json.loads((out / "result.json").read_text())


def two_node_rows(tok: str, url: str, steps: int = 30) -> dict | None:
    from pipelines.sim_nodes import namespaces_permitted
    from pipelines.spec import load_spec
    from pipelines.train.ckpt import protocol as ck
    from pipelines.train.ckpt import local as ckpt_local
    from pipelines.train.ckpt import s3_tier as ckpt_s3
    from pipelines.train.ckpt import tiers as ckpt_tiers

    why = namespaces_permitted()
    if why:
        print(f"  two nodes: skipped ({why})")
        return None
    base = ROOT / "var" / "bench" / "ckpt-nodes"
    shutil.rmtree(base, ignore_errors=True)
    disk = lambda name: base / "disks" / name  # noqa: E731
    rows: dict = {}
    for label, l0 in (("node-local L0", base / "l0"), ("L0 on the shared dir (anchor)", base / "shared" / "l0")):
        prefix = "local" if l0 == base / "l0" else "shared"
        res = _two_node_job(tok, base, url, l0, [disk(f"{prefix}-0"), disk(f"{prefix}-1")], steps, prefix)
        promote = list(res["ckpt"]["promote_s"].values())
        rows[label] = {"stall_s_mean": res["ckpt"]["stall_s_mean"], "saves": res["ckpt"]["saves"],
                       "promote_s_mean": sum(promote) / len(promote)}
        print(f"  two nodes, {label}: stall {rows[label]['stall_s_mean'] * 1000:.0f} ms, to a global commit on "
              f"L1 {rows[label]['promote_s_mean']:.2f} s", flush=True)
    # restores of the node-local job's final step on a replacement node
    spec = load_spec(None, [f"checkpoint.l0={base}/l0", f"checkpoint.l1={base}/shared/l1-local",
                            f"services.s3_endpoint_url={url}", "services.s3_bucket=bench-nodes",
                            f"checkpoint.l2_prefix={RUN}/local"], env={})
    rel = f"run/key/{ck.step_name(steps)}"
    final_l1 = Path(ckpt_tiers.tier_locations(spec, rel)["L1"])
    nbytes = sum(i["bytes"] for i in ck.verify_local(final_l1)["files"].values())
    t0 = time.perf_counter()
    ckpt_local.copy_local(final_l1, base / "one-rank-l1")
    one_l1 = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt_s3.download_checkpoint(spec, ckpt_tiers.tier_locations(spec, rel)["L2"], base / "one-rank-l2")
    one_l2 = time.perf_counter() - t0
    endpoint = endpoint_readers(spec, ckpt_tiers.tier_locations(spec, rel)["L2"])
    res = _two_node_job(tok, base, url, base / "l0", [disk("local-0"), disk("replacement-1")], steps, "local")
    from_l1 = res["restore_s"]
    shutil.rmtree(base / "shared" / "l1-local")
    res2 = _two_node_job(tok, base, url, base / "l0", [disk("fresh-0"), disk("fresh-1")], steps, "local")
    from_l2 = res2["restore_s"]
    assert res["resumed_from"]["tier"] == "L1" and res2["resumed_from"]["tier"] == "L2", (res, res2)
    rows["restore"] = {"bytes": nbytes, "replacement_from_L1_s": from_l1, "every_node_from_L2_s": from_l2,
                       "one_rank_whole_from_L1_s": one_l1, "one_rank_whole_from_L2_s": one_l2,
                       "parts_L1": res["resumed_from"]["parts"], "parts_L2": res2["resumed_from"]["parts"],
                       "endpoint_MBps": endpoint}
    print(f"  restore of {nbytes / 1e6:.0f} MB: replacement from L1 {from_l1:.2f} s (one rank, whole: {one_l1:.2f} s); "
          f"every node its part from L2 {from_l2:.2f} s (one rank, whole: {one_l2:.2f} s)", flush=True)
    shutil.rmtree(base, ignore_errors=True)
    from pipelines.storage import s3

    _empty(s3.client(spec), "bench-nodes")  # keep var/s3/store small
    return rows


_READ = """
import sys, boto3
c = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1", aws_access_key_id="embedded",
                 aws_secret_access_key="embedded-secret")
for key in sys.argv[3:]:
    c.get_object(Bucket=sys.argv[2], Key=key)["Body"].read()
"""


def endpoint_readers(spec, uri: str) -> dict:
    """The S3 endpoint's aggregate read throughput with one reader process and with two (each half the step's
    files), plain boto3: what a per-node parallel download can get from this endpoint at best."""
    import subprocess

    from pipelines.storage.s3 import endpoint_url, split_uri
    from pipelines.train.ckpt import s3_tier as ckpt_s3

    bucket, prefix = split_uri(uri)
    files = ckpt_s3.read_s3_manifest(spec, uri)["files"]
    keys = sorted(files, key=lambda r: -files[r]["bytes"])
    total = sum(f["bytes"] for f in files.values())
    out = {}
    for readers in (1, 2):
        shares = [[f"{prefix}/{k}" for k in keys[i::readers]] for i in range(readers)]
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", _READ, endpoint_url(spec), bucket, *share]) for share in shares]
        assert all(p.wait() == 0 for p in procs)
        out[readers] = round(total / (time.perf_counter() - t0) / 1e6, 1)
    print(f"  the endpoint alone: 1 reader {out[1]} MB/s, 2 readers {out[2]} MB/s in all", flush=True)
    return out


def print_two_nodes(rows: dict) -> None:
    shared = rows["L0 on the shared dir (anchor)"]
    print("\n| 2 nodes × 1 rank, ≈ 14 M params | save stall | to global commit on L1 | stall ÷ shared-L0 stall |")
    print("|---|---|---|---|")
    for label, r in rows.items():
        if label != "restore":
            print(f"| {label} | {r['stall_s_mean'] * 1000:.0f} ms | {r['promote_s_mean']:.2f} s | "
                  f"{r['stall_s_mean'] / shared['stall_s_mean']:.2f} |")
    r = rows["restore"]
    print(f"\n| restore of {r['bytes'] / 1e6:.0f} MB (all ranks ready) | ours | one rank, whole checkpoint (anchor) | "
          "anchor ÷ ours |\n|---|---|---|---|")
    print(f"| replacement node, from L1 (parts {r['parts_L1']}) | {r['replacement_from_L1_s']:.2f} s | "
          f"{r['one_rank_whole_from_L1_s']:.2f} s | {r['one_rank_whole_from_L1_s'] / r['replacement_from_L1_s']:.2f} |")
    print(f"| every node its own part, from L2 | {r['every_node_from_L2_s']:.2f} s | {r['one_rank_whole_from_L2_s']:.2f} s "
          f"| {r['one_rank_whole_from_L2_s'] / r['every_node_from_L2_s']:.2f} |")
    e = r["endpoint_MBps"]
    print(f"| the S3 endpoint alone, plain boto3 GETs: 2 reader processes vs 1 | {e[2]} MB/s | {e[1]} MB/s | "
          f"{e[2] / e[1]:.2f} |")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenize-manifest", default=None, help="For the goodput runs (default: the newest under var/runs).")
    ap.add_argument("--steps", type=int, default=150, help="Steps of each goodput run.")
    ap.add_argument("--repeats", type=int, default=3, help="Runs of each goodput configuration (median reported).")
    ap.add_argument("--sizes", default="10m,100m,350m")
    ap.add_argument("--out", default=None, help="Default var/bench/ckpt.json (--only stall: var/bench/ckpt-stall.json).")
    ap.add_argument("--only", choices=["nodes", "stall"], default=None,
                    help="Run only the two-node part (nodes) or only the save-stall part (stall).")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="--only stall: where the model and its AdamW state live.")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="--only stall: the default process group (nccl: run it under torchrun, --device cuda).")
    args = ap.parse_args(argv)
    if args.only != "stall" and (args.device != "cpu" or args.backend != "gloo"):
        ap.error("--device/--backend apply to --only stall")
    return args


def only_nodes(tok: str, out: str) -> int:
    from pipelines.manifest import atomic_write_text
    from pipelines.storage import s3

    url = s3.start()
    try:
        rows = two_node_rows(tok, url)
    finally:
        s3.stop()
    if rows:
        print_two_nodes(rows)
        atomic_write_text(out.replace(".json", "-nodes.json"), json.dumps(rows, indent=2))
    return 0


def every_part(args, tok: str) -> dict:
    """The stall rows (one process group of one rank), the promotion row, the goodput runs and the two nodes."""
    import torch
    import torch.distributed as dist

    from pipelines.storage import s3

    torch.set_num_threads(2)
    base = ROOT / "var" / "bench" / "ckpt-sizes"
    shutil.rmtree(base, ignore_errors=True)
    port = 29500 + os.getpid() % 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        stalls, ckpt = stall_rows(args.sizes.split(","), base)
    finally:
        dist.destroy_process_group()
    url = s3.start()  # the embedded S3 endpoint (rclone serve s3) on 127.0.0.1 for L2
    try:
        promo = promotion_row(ckpt, base, url)
        shutil.rmtree(base, ignore_errors=True)
        good = goodput_rows(tok, args.steps, url, args.repeats)
        nodes = two_node_rows(tok, url)
    finally:
        s3.stop()
    return {"stall": stalls, "promotion": promo, "goodput": good, "two_nodes": nodes,
            "machine": {"cpus": os.cpu_count()}}


def print_every_part(result: dict, repeats: int) -> None:
    promo = result["promotion"]
    print_stalls(result["stall"])
    print(f"\n| promotion of {promo['bytes'] / 1e9:.2f} GB | MB/s | ours ÷ plain |\n|---|---|---|")
    print(f"| ours: L0 → L1 → L2, verified, COMMIT last | {promo['ours_MBps']} | {promo['ratio']:.2f} |")
    print(f"| plain copyfile + upload_file (anchor) | {promo['plain_MBps']} | 1.00 |")
    print(f"\n| 2-rank demo run (median of {repeats}) | goodput tokens/s | runs | saves | ÷ no checkpoints |")
    print("|---|---|---|---|---|")
    for r in result["goodput"]:
        print(f"| {r['run']} | {r['goodput_tokens_per_s']:,.0f} | {', '.join(f'{x:,}' for x in r['all_tokens_per_s'])} | "
              f"{r['saves']} | {r['ratio']:.3f} |")
    if result["two_nodes"]:
        print_two_nodes(result["two_nodes"])


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.only == "stall":
        return only_stall(args)
    args.out = args.out or str(ROOT / "var" / "bench" / "ckpt.json")
    from pipelines.manifest import atomic_write_text, newest_manifest

    tok = args.tokenize_manifest or newest_manifest(ROOT / "var" / "runs", "tokenize")
    if tok is None:
        print("ckpt_bench: no tokenize manifest under var/runs; run `make demo` first or pass --tokenize-manifest",
              file=sys.stderr)
        return 2
    tok = str(tok)
    if not Path(tok).is_file():
        print(f"ckpt_bench: --tokenize-manifest {tok}: no such file (a tokenize stage's manifest.json)", file=sys.stderr)
        return 2
    if args.only == "nodes":
        return only_nodes(tok, args.out)

    result = every_part(args, tok)
    print_every_part(result, args.repeats)
    atomic_write_text(args.out, json.dumps(result, indent=2))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
