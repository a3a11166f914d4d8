"""torchft probe: do "replica groups that keep training" work here (CPU, gloo)?

Standalone measurement script; it is NOT part of the template and does not
import anything from it.  It needs a separate venv with torch + torchft:

    python3 -m venv /tmp/ftvenv
    /tmp/ftvenv/bin/pip install torch==2.13.0 numpy
    /tmp/ftvenv/bin/pip install --no-deps torchft==0.2.0
    /tmp/ftvenv/bin/pip install opentelemetry-api opentelemetry-sdk \
        opentelemetry-exporter-otlp-proto-http      # torchft's other deps

Run (from the repo root; the script prepends the directory of sys.executable
to PATH so ``torchft_lighthouse`` and ``torchrun`` come from the venv):

    /tmp/ftvenv/bin/python bench/torchft_probe.py --out /tmp/ftprobe \
        --phases plain,ft,ft_quiet,kill,kill_patch,kill_hb1000_warm_patch,\
torchrun_hb1000_warm_patch,kill2_hb1000_warm_patch --steps 500 --total 4000 --kill-at 100

Each phase uses fresh ports and its own lighthouse
(``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 1000``):

* plain    -- 2 processes, torch.distributed gloo + torch DDP, small MLP on
              random data; per-step wall times (baseline).
* ft       -- lighthouse + 2 replica groups x 1 rank, same model/loop through
              torchft.Manager + torchft.DistributedDataParallel +
              torchft.Optimizer on torchft.ProcessGroupGloo (per-step quorum),
              no failure -> steady-state step time vs plain.
* kill     -- as ft, but once both groups train in one quorum and group 1 is at
              step >= --kill-at, group 1's worker is SIGKILLed and restarted by
              this script --restart-delay s (default 1) later as a plain
              process.  Records the healthy group's longest gap between steps
              around the failure, the steps it committed while group 1 was
              down, the restarted group's timeline (process start, imports,
              Manager up, first committed step), the step it resumes at, whether
              torchft logged "healing required ... fetching checkpoint" and
              whether its parameter checksum equals the healthy group's at the
              same steps (i.e. it healed from the live peer, not from disk).
* torchrun -- as kill, but each group is `torchrun --nproc_per_node=N
              --max-restarts=1 -- ...`; the restart is done by torchrun.
* kill2    -- the torchrun variant with 2 ranks per replica group.

Phase-name suffixes: _hbN -> lighthouse --heartbeat_timeout_ms N (default
5000); _warm -> import torch DDP's lazy deps before Manager() starts
heartbeating; _patch -> work around torchft 0.2.0's `assert fut._fut` crash in
the DDP comm hook (see PatchedDDP); _quiet -> python logging at WARNING.

Per-step logs (JSON lines) and worker stdout/stderr are written under --out;
a summary is printed and written to <out>/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve()


# --------------------------------------------------------------------------
# worker side
# --------------------------------------------------------------------------
def _model_and_data(args, seed_base):
    import torch
    from torch import nn

    torch.manual_seed(0)  # identical init in every process
    model = nn.Sequential(
        nn.Linear(args.dim, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, 10),
    )
    teacher = torch.randn(args.dim, 10, generator=torch.Generator().manual_seed(1))

    def batch(step):
        g = torch.Generator().manual_seed(seed_base * 1_000_003 + step)
        x = torch.randn(args.batch, args.dim, generator=g)
        y = (x @ teacher).argmax(dim=1)
        return x, y

    return model, batch


def _csum(model):
    import torch

    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))


def worker(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    gid = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    log_path = Path(args.log.format(gid=gid, rank=rank))
    log = open(log_path, "a", buffering=1)

    def emit(**kw):
        kw.setdefault("t", time.time())
        kw["pid"] = os.getpid()
        log.write(json.dumps(kw) + "\n")

    emit(
        ev="start",
        mode=args.mode,
        gid=gid,
        rank=rank,
        world=world,
        restart=os.environ.get("TORCHELASTIC_RESTART_COUNT"),
    )

    if args.mode == "plain":
        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=30))
        model, batch = _model_and_data(args, seed_base=rank)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        emit(ev="ready")
        for step in range(args.steps):
            x, y = batch(step)
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            emit(ev="step", step=step + 1, committed=True, loss=float(loss), csum=_csum(model) if args.csum else None)
        emit(ev="done", csum=_csum(model))
        dist.destroy_process_group()
        return

    # ---------------- torchft ----------------
    import logging

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    emit(ev="imported")
    if args.prewarm:
        # torch DDP's constructor lazily imports torch._dynamo & co (~800 modules,
        # seconds on a loaded box).  Pay that *before* Manager() starts
        # heartbeating, otherwise a restarted group heartbeats for seconds without
        # joining the quorum and the lighthouse's split-brain rule
        # (participants > heartbeating/2) blocks the healthy group meanwhile.
        from torchft.process_group import ProcessGroupDummy

        torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1), process_group=ProcessGroupDummy(0, 1))
        emit(ev="prewarmed")
    store = None
    if "TORCHELASTIC_RUN_ID" not in os.environ and rank == 0:
        # Manager connects to MASTER_ADDR:MASTER_PORT as a *client*; torchrun's
        # agent normally hosts that store.  Without torchrun we host it here.
        store = TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=True, wait_for_workers=False
        )

    model, batch = _model_and_data(args, seed_base=gid * 100 + rank)

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        emit(ev="loaded_peer_state")

    def state_dict():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    transport = None
    if args.transport == "pg":
        from torchft.checkpointing.pg_transport import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu"))
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"probe_{gid}",
        timeout=timedelta(seconds=args.ft_timeout),
        hostname="localhost",
        checkpoint_transport=transport,
    )
    emit(ev="manager")  # ManagerServer (rank 0) is heartbeating from here on
    ddp_cls = DistributedDataParallel
    if args.patch_ddp:

        class PatchedDDP(DistributedDataParallel):
            # torchft 0.2.0 bug: if the gloo allreduce fails (peer SIGKILLed
            # mid-step), _ManagedWork.wait() swallows the error and reports it
            # to the manager, but the future is never wired up, so
            # ddp._comm_hook's `assert fut._fut` kills the *healthy* worker.
            # Return the (unreduced) bucket instead; should_commit() is False
            # for this step anyway because the error was reported.
            @staticmethod
            def _comm_hook(state, bucket):
                work = state.allreduce(bucket.buffer())
                work.wait()
                fut = work.get_future()
                if getattr(fut, "_fut", None) is None:
                    f = torch.futures.Future()
                    f.set_result(bucket.buffer())
                    emit(ev="patched_hook_used")
                    return f
                return fut._fut

        ddp_cls = PatchedDDP
    ddp = ddp_cls(manager, model)
    emit(ev="ddp")
    opt = Optimizer(manager, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    emit(ev="ready")
    i = 0
    while manager.current_step() < args.total:
        before = manager.current_step()
        x, y = batch(i)
        i += 1
        opt.zero_grad()  # starts the (async) quorum
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()  # should_commit(); only steps the optimizer if True
        after = manager.current_step()
        emit(
            ev="step",
            step=after,
            prev=before,
            committed=after > before,
            loss=float(loss),
            n=manager.num_participants(),
            csum=_csum(model) if args.csum else None,
        )
    emit(ev="done", csum=_csum(model))
    manager.shutdown(wait=False)
    del store
    log.close()
    os._exit(0)  # don't hang in atexit on a half-dead peer


# --------------------------------------------------------------------------
# orchestrator side
# --------------------------------------------------------------------------
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(path):
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def worker_cmd(args, mode, log, total=None):
    total = args.total if total is None else total
    return (
        [
            sys.executable,
            str(HERE),
            "--role",
            "worker",
            "--mode",
            mode,
            "--log",
            log,
            "--steps",
            str(args.steps),
            "--total",
            str(total),
            "--dim",
            str(args.dim),
            "--hidden",
            str(args.hidden),
            "--batch",
            str(args.batch),
            "--transport",
            args.transport,
            "--pg-timeout",
            str(args.pg_timeout),
            "--ft-timeout",
            str(args.ft_timeout),
        ]
        + (["--csum"] if args.csum else [])
        + (["--prewarm"] if args.prewarm else [])
        + (["--patch-ddp"] if args.patch_ddp else [])
        + (["--quiet"] if args.quiet else [])
    )


class Run:
    def __init__(self, args, name):
        self.args = args
        self.dir = Path(args.out) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in self.dir.glob("*"):
            f.unlink()
        self.procs = []

    def spawn(self, cmd, env, tag):
        out = open(self.dir / f"{tag}.out", "a")
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(p)
        return p

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()


def base_env():
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + ":" + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env["MASTER_ADDR"] = "127.0.0.1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def steps_of(recs):
    return [r for r in recs if r.get("ev") == "step"]


def step_times(recs, lo, hi):
    """median/mean wall time between consecutive committed steps with step in (lo, hi]."""
    st = [r for r in steps_of(recs) if r.get("committed")]
    dts = [
        b["t"] - a["t"] for a, b in zip(st, st[1:], strict=False) if lo < b["step"] <= hi and b["step"] == a["step"] + 1
    ]
    if not dts:
        return None
    dts.sort()
    return {
        "n": len(dts),
        "median_ms": 1e3 * statistics.median(dts),
        "mean_ms": 1e3 * statistics.fmean(dts),
        "p90_ms": 1e3 * dts[int(0.9 * (len(dts) - 1))],
    }


def phase_plain(args):
    run = Run(args, "plain")
    port = free_port()
    try:
        for r in range(2):
            env = base_env() | {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "MASTER_PORT": str(port)}
            run.spawn(worker_cmd(args, "plain", str(run.dir / "rank{rank}.jsonl")), env, f"rank{r}")
        rc = [p.wait(timeout=args.timeout) for p in run.procs]
    finally:
        run.cleanup()
    recs = read_log(run.dir / "rank0.jsonl")
    return {"rc": rc, "steady": step_times(recs, 20, args.steps)}


def start_lighthouse(run, args):
    port = free_port()
    cmd = [
        "torchft_lighthouse",
        "--min_replicas",
        "1",
        "--quorum_tick_ms",
        "100",
        "--join_timeout_ms",
        str(args.join_timeout_ms),
        "--bind",
        f"[::]:{port}",
    ]
    if args.heartbeat_timeout_ms:
        cmd += ["--heartbeat_timeout_ms", str(args.heartbeat_timeout_ms)]
    run.spawn(cmd, base_env() | {"RUST_BACKTRACE": "1"}, "lighthouse")
    time.sleep(0.5)
    return f"http://localhost:{port}", cmd


def group_env(args, lh, gid, master_port):
    return base_env() | {
        "REPLICA_GROUP_ID": str(gid),
        "NUM_REPLICA_GROUPS": "2",
        "TORCHFT_LIGHTHOUSE": lh,
        "MASTER_PORT": str(master_port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }


def spawn_group(run, args, lh, gid, use_torchrun, gsize, total):
    mp = free_port()
    env = group_env(args, lh, gid, mp)
    log = str(run.dir / "g{gid}r{rank}.jsonl")
    wcmd = worker_cmd(args, "ft", log, total)
    if use_torchrun:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            env.pop(k)
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            f"--nproc_per_node={gsize}",
            "--nnodes=1",
            f"--master_port={mp}",
            "--max-restarts=1",
            "--monitor-interval=0.1",
            "--",
        ] + wcmd[1:]
    else:
        cmd = wcmd
    return run.spawn(cmd, env, f"g{gid}"), cmd


def wait_for(pred, timeout, poll=0.02):
    t0 = time.time()
    while time.time() - t0 < timeout:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    return None


def analyse_ft(run, args, gsize, kill_t=None, restart_t=None, kill_step=None, total=0):
    res = {}
    for gid in range(2):
        for rank in range(gsize):
            recs = read_log(run.dir / f"g{gid}r{rank}.jsonl")
            st = steps_of(recs)
            key = f"g{gid}r{rank}"
            d = {
                "n_step_records": len(st),
                "last_step": st[-1]["step"] if st else None,
                "uncommitted": sum(1 for r in st if not r["committed"]),
                "done": any(r.get("ev") == "done" for r in recs),
                "final_csum": next((r["csum"] for r in recs if r.get("ev") == "done"), None),
                "starts": [r["t"] for r in recs if r.get("ev") == "start"],
                "steady_before_kill": step_times(recs, 20, (kill_step or total) - 2),
            }
            res[key] = d
    if kill_t is None:
        return res
    # healthy group: longest gap between consecutive step records around the failure
    h = steps_of(read_log(run.dir / "g0r0.jsonl"))
    win = [r for r in h if kill_t - 2 <= r["t"] <= kill_t + 60]
    gaps = [(b["t"] - a["t"], a["step"], b["step"], a["t"] - kill_t) for a, b in zip(win, win[1:], strict=False)]
    g = max(gaps) if gaps else None
    steady = res["g0r0"]["steady_before_kill"]
    res["healthy_max_gap_s"] = g[0] if g else None
    res["healthy_max_gap_between_steps"] = [g[1], g[2]] if g else None
    res["healthy_max_gap_starts_after_kill_s"] = g[3] if g else None
    if g and steady:
        res["healthy_max_gap_in_step_times"] = g[0] / (steady["median_ms"] / 1e3)
    # healthy group's top 5 gaps after kill, to see the rejoin stall too
    res["healthy_top_gaps"] = sorted(
        [{"gap_s": round(x[0], 3), "steps": [x[1], x[2]], "t_after_kill_s": round(x[3], 3)} for x in gaps],
        key=lambda z: -z["gap_s"],
    )[:5]
    res["healthy_uncommitted_after_kill"] = sum(1 for r in h if r["t"] >= kill_t and not r["committed"])
    # restarted group
    rr = read_log(run.dir / "g1r0.jsonl")
    after = [r for r in rr if r["t"] >= (restart_t or kill_t)]
    start = next((r for r in after if r.get("ev") == "start"), None)
    ready = next((r for r in after if r.get("ev") == "ready"), None)
    first = next((r for r in after if r.get("ev") == "step"), None)
    firstc = next((r for r in after if r.get("ev") == "step" and r["committed"]), None)
    loaded = next((r for r in after if r.get("ev") == "loaded_peer_state"), None)
    ev_t = lambda name: next((r["t"] - kill_t for r in after if r.get("ev") == name), None)  # noqa: E731
    res["healthy_committed_steps_kill_to_rejoin"] = sum(
        1 for r in h if r["committed"] and kill_t <= r["t"] <= (firstc["t"] if firstc else 1e99)
    )
    if firstc:
        res["healthy_steady_after_rejoin"] = step_times(read_log(run.dir / "g0r0.jsonl"), firstc["step"] + 20, total)
    res["restart"] = {
        "t_after_kill_s": {k: ev_t(k) for k in ("start", "imported", "prewarmed", "manager", "ddp", "ready")},
        "kill_step": kill_step,
        "process_start_after_kill_s": start["t"] - kill_t if start else None,
        "manager_ready_after_kill_s": ready["t"] - kill_t if ready else None,
        "first_step_record_after_kill_s": first["t"] - kill_t if first else None,
        "first_step_record": first,
        "first_committed_after_kill_s": firstc["t"] - kill_t if firstc else None,
        "first_committed_step": firstc["step"] if firstc else None,
        "loaded_peer_state_after_kill_s": loaded["t"] - kill_t if loaded else None,
        "healthy_step_at_rejoin": max((r["step"] for r in h if firstc and r["t"] <= firstc["t"]), default=None),
    }
    if firstc and args.csum:
        # params equal to the healthy group's at the same step?
        hs = {r["step"]: r.get("csum") for r in h}
        same = [
            (r["step"], r["csum"], hs.get(r["step"]))
            for r in after
            if r.get("ev") == "step" and r["committed"] and r["step"] in hs
        ][:5]
        res["restart"]["csum_vs_healthy_first5"] = same
    out_txt = ""
    for f in sorted(run.dir.glob("g1*.out")):
        out_txt += f.read_text(errors="replace")
    res["restart"]["log_healing_required"] = "healing required" in out_txt
    res["restart"]["log_lines"] = [
        ln[:300]
        for ln in out_txt.splitlines()
        if any(
            k in ln
            for k in (
                "healing required",
                "fetching checkpoint",
                "applying pending",
                "Loaded state dict",
                "Traceback",
                "Error",
                "error",
            )
        )
    ][:12]
    h_out = (run.dir / "g0.out").read_text(errors="replace")
    res["healthy_worker_starts"] = len(res["g0r0"]["starts"])
    res["healthy_assert_fut_crashes"] = h_out.count("assert fut._fut")
    res["healthy_gloo_errors"] = h_out.count("got exception waiting for work")
    res["patched_hook_used"] = sum(1 for r in read_log(run.dir / "g0r0.jsonl") if r.get("ev") == "patched_hook_used")
    res["healthy_log_lines"] = [
        ln[:300]
        for ln in h_out.splitlines()
        if any(k in ln for k in ("peers need recovery", "reconfiguring", "should_commit=False", "Traceback"))
    ][:12]
    return res


def phase_ft(args, name, kill, use_torchrun=False, gsize=1, hb_ms=0):
    run = Run(args, name)
    args = argparse.Namespace(**vars(args))
    args.prewarm = args.prewarm or "_warm" in name
    args.patch_ddp = args.patch_ddp or "_patch" in name
    args.quiet = args.quiet or "_quiet" in name
    args.heartbeat_timeout_ms = hb_ms or args.heartbeat_timeout_ms
    total = args.total if kill else args.steps
    try:
        lh, lh_cmd = start_lighthouse(run, args)
        groups = {}
        for gid in range(2):
            groups[gid] = spawn_group(run, args, lh, gid, use_torchrun, gsize, total)
        kill_t = restart_t = kill_step = None
        if kill:

            def victim():
                if groups[1][0].poll() is not None:
                    raise RuntimeError(f"group 1 exited early rc={groups[1][0].returncode}")
                recs = read_log(run.dir / "g1r0.jsonl")
                st = steps_of(recs)
                # only kill once both groups have trained together (joint quorum)
                if st and st[-1]["step"] >= args.kill_at and st[-1].get("n") == 2:
                    return st[-1]
                return None

            v = wait_for(victim, args.timeout)
            if not v:
                raise RuntimeError("group 1 never reached kill step")
            # SIGKILL the worker process (not torchrun) -- pid from its own log
            pid = v["pid"]
            kill_t = time.time()
            os.kill(pid, signal.SIGKILL)
            kill_step = v["step"]
            if not use_torchrun:
                groups[1][0].wait()
                time.sleep(args.restart_delay)
                restart_t = time.time()
                groups[1] = spawn_group(run, args, lh, 1, False, gsize, total)
            else:
                restart_t = kill_t
        rc = {}
        for gid, (p, _) in groups.items():
            try:
                rc[gid] = p.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                rc[gid] = "timeout"
    finally:
        run.cleanup()
    res = analyse_ft(run, args, gsize, kill_t, restart_t, kill_step, total)
    res["rc"] = rc
    res["lighthouse_cmd"] = " ".join(lh_cmd)
    res["group_cmd_example"] = " ".join(groups[1][1])
    return res


def orchestrate(args):
    Path(args.out).mkdir(parents=True, exist_ok=True)
    import torch

    summary = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "loadavg_start": os.getloadavg(),
        "args": vars(args),
    }
    try:
        from importlib.metadata import version

        summary["torchft"] = version("torchft")
    except Exception as e:  # noqa: BLE001
        summary["torchft"] = repr(e)
    phases = args.phases.split(",")
    for ph in phases:
        t0 = time.time()
        print(f"=== phase {ph} (load {os.getloadavg()})", flush=True)
        try:
            hb = int(ph.split("_hb")[1].split("_")[0]) if "_hb" in ph else 0
            base = ph.split("_")[0]
            if ph == "plain":
                r = phase_plain(args)
            elif base == "ft":
                r = phase_ft(args, ph, kill=False)
            elif base == "kill":
                r = phase_ft(args, ph, kill=True, hb_ms=hb)
            elif base == "torchrun":
                r = phase_ft(args, ph, kill=True, use_torchrun=True, hb_ms=hb)
            elif base == "kill2":
                r = phase_ft(args, ph, kill=True, use_torchrun=True, gsize=2, hb_ms=hb)
            else:
                raise ValueError(ph)
        except Exception as e:  # noqa: BLE001
            r = {"error": repr(e)}
        r["wall_s"] = time.time() - t0
        r["loadavg_end"] = os.getloadavg()
        summary[ph] = r
        print(json.dumps(r, indent=1, default=str), flush=True)
        (Path(args.out) / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", default="orchestrator", choices=["orchestrator", "worker"])
    ap.add_argument("--mode", default="ft", choices=["ft", "plain"])
    ap.add_argument("--log", default="")
    ap.add_argument("--out", default="/tmp/ftprobe")
    ap.add_argument(
        "--phases",
        default="plain,ft,kill_patch,kill_hb1000_warm_patch,torchrun_hb1000_warm_patch,kill2_hb1000_warm_patch",
    )
    ap.add_argument("--steps", type=int, default=300, help="steps of plain / ft phases")
    ap.add_argument("--total", type=int, default=300, help="torchft steps to run to")
    ap.add_argument("--kill-at", type=int, default=80)
    ap.add_argument("--restart-delay", type=float, default=1.0)
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--transport", default="http", choices=["http", "pg"])
    ap.add_argument("--pg-timeout", type=float, default=5.0)
    ap.add_argument("--ft-timeout", type=float, default=30.0)
    ap.add_argument("--join-timeout-ms", type=int, default=1000)
    ap.add_argument("--heartbeat-timeout-ms", type=int, default=0, help="0 = lighthouse default (5000)")
    ap.add_argument("--csum", action="store_true", default=True)
    ap.add_argument(
        "--quiet", action="store_true", help="python logging at WARNING instead of INFO (phase suffix _quiet)"
    )
    ap.add_argument("--patch-ddp", action="store_true", help="work around the comm-hook assert (phase suffix _patch)")
    ap.add_argument(
        "--prewarm", action="store_true", help="import torch DDP's lazy deps before Manager() (phase suffix _warm)"
    )
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    if args.role == "worker":
        worker(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
