"""The processes of a multi-rank job on one machine: a free loopback port, the ranks started from
multiprocessing's forkserver (each runs a named function and reports a JSON file), and a rank's
gloo group with its device mesh. What a real sharded recording and a sharded replay both start."""

from __future__ import annotations

import functools
import importlib
import json
import os
import socket
import tempfile
from pathlib import Path

from ..base.errors import PlanError


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Imported once by the process that starts every rank (multiprocessing's forkserver), so that
# a rank starts as a fork of an interpreter that has them already: about 5 s of imports per
# rank otherwise (torch.distributed, transformers' model index), paid by every run.
PRELOAD = ["taichi_plan.replay.distributed", "taichi_plan.replay.measure", "taichi_plan.record.fsdp", "taichi_plan.record.fsdp_rank",
           "taichi_plan.record.ddp", "torch.distributed.fsdp", "transformers.models", "transformers.modeling_utils"]


@functools.cache
def _rank_context():
    """The start method of the ranks: multiprocessing's ``forkserver``, with :data:`PRELOAD`
    (the server is started from this process's state only once, then forks each rank from
    its own single-threaded interpreter: no thread or lock of this process is inherited)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _rank_process(job: str, rank: int, threads: int, env: dict) -> None:
    """A rank's process: the caller's environment as it is now (the forkserver kept the one
    of its start; multiprocessing itself gives each child the caller's directory and
    ``sys.path``), its output to ``rank<r>.log`` beside the job, ``threads`` torch threads
    (``OMP_NUM_THREADS`` of the caller, as a fresh process would have), then the job."""
    import torch

    os.environ.clear()
    os.environ.update(env)
    fd = os.open(Path(job).parent / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    torch.set_num_threads(threads)
    _main([job, str(rank)])


def spawn_ranks(nproc: int, target: str, spec: dict, timeout_s: float = 600.0) -> list[dict]:
    """Start ``nproc`` processes (one per rank, as torchrun would, joined on a free loopback
    port; forked by multiprocessing's forkserver, :func:`_rank_context`) that each run the
    function ``target`` (``"package.module:function"``, imported in the rank) with ``(rank, nproc, port, out_dir, **spec)``;
    each writes ``out_dir/rank<r>.json``. Returns those, by rank. A rank that fails or
    outlives ``timeout_s`` ends the others; its error is raised here."""
    import time

    port = free_port()
    threads = int(os.environ.get("OMP_NUM_THREADS", "1") or 1)
    with tempfile.TemporaryDirectory(prefix="taichi-ranks-") as out_dir:
        job = Path(out_dir) / "job.json"
        job.write_text(json.dumps({"target": target, "nproc": nproc, "port": port, "spec": spec}))
        ctx = _rank_context()
        env = dict(os.environ)
        procs = [ctx.Process(target=_rank_process, args=(str(job), r, threads, env), daemon=True)
                 for r in range(nproc)]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                if p.pid is not None:  # (started)
                    p.join()
        out = []
        for r, p in enumerate(procs):
            f = Path(out_dir) / f"rank{r}.json"
            if not f.exists():
                why = "timed out" if p.exitcode in (None, -9) else f"exited with code {p.exitcode}"
                log = Path(out_dir) / f"rank{r}.log"
                tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:]) if log.exists() else ""
                raise PlanError(f"Rank {r} of the {nproc}-rank run {why} before reporting. Its last output:\n{tail}")
            out.append(json.loads(f.read_text()))
        errors = [o["error"] for o in out if o.get("error")]
        if errors:
            raise PlanError(errors[0])
        return out


def init_gloo(rank: int, nproc: int, port: int, replicas: int = 1):
    """Join the gloo process group on loopback; returns the CPU device mesh (1-D, or HSDP's 2-D
    of ``replicas`` rows: :func:`taichi_plan.torch_common.fsdp.device_mesh`)."""
    import torch.distributed as dist

    from .fsdp import device_mesh

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nproc)
    return device_mesh(nproc, replicas)


def _main(argv: list[str]) -> None:
    """One rank of :func:`spawn_ranks`: ``argv`` is the job file and the rank."""
    job = json.loads(Path(argv[0]).read_text())
    rank = int(argv[1])
    module, _, name = job["target"].partition(":")
    fn = getattr(importlib.import_module(module), name)
    fn(rank, job["nproc"], job["port"], str(Path(argv[0]).parent), **job["spec"])
