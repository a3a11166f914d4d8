"""What snapshots on an S3 store cost the steps, against a local folder, and how long a snapshot takes to commit.

    python bench/store_overhead.py [--repeats 2] [--models small,large] [--steps N] [--out bench/STORE.md]

Bakes the template, starts moto's S3 server on 127.0.0.1 (a process of its own, as tests/test_store.py does) and
runs the baked train.py on 2 CPU ranks (gloo, one thread each) three ways, alternating, `--repeats` times each:
  none    --snapshot-every equal to --max-steps: only the final snapshot, after the last timed step
  local   a snapshot every step (small model) or every 10 (large, tens of MB) to a local folder (under the
          system's temp dir, where the store's staging goes too)
  store   the same to s3://BUCKET/run-N (AWS_ENDPOINT_URL = the moto server, dummy credentials)
Step times come from bench/probe.py (an optimizer step hook): the gaps between optimizer steps on each rank,
after a warm-up, so each gap holds one step and the snapshot saved after it. A small wrapper around train.main
notes on rank 0, for every step, when the training thread called Snapshots.save() and returned from it, and
when that step's manifest was written (the commit: writer.write_json_atomic for a folder, Store.put_json for the
store); nothing in the product changes. Also noted: the CPU seconds moto's server used during each run (it shares
the 2 cores with training here; a real store does not), and the WARNINGs the run printed.
Writes bench/STORE.md and bench/STORE.json.
"""

import argparse
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BENCH, CpuMeter, Run, bake, load, machine, scratch_dir, wait_for  # noqa: E402

# The demo MLP (32 inputs, width x depth; a snapshot holds its weights, AdamW's two moments and the rest): the
# arguments, the snapshot interval of the local and store runs, and the steps of each run. The small one with a
# snapshot after every step; the large one (tens of MB a snapshot) every 10 steps, where an upload has those 10
# steps to finish in.
MODELS = {
    "small": (["--width", "256", "--depth", "3", "--batch-size", "64"], 1, 200),
    "large": (["--width", "1024", "--depth", "6", "--batch-size", "64"], 10, 150),
}
CASES = ("none", "local", "store")
WARMUP = 20  # steps left out of the step times: allocator, first saves (staging buffers), first uploads
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

WRAPPER = """
import atexit, json, os, sys, time

if __name__ == "__main__":
    import train
    from {package}.machinery import warmstart
    from {package}.machinery.snapshot import store, writer
    from {package}.machinery.snapshot.format import MANIFEST

    saves, returns, commits = {{}}, {{}}, {{}}

    def step_of(path):
        return int(path.replace(os.sep, "/").split("/")[-2].split("-")[-1])

    original_save = writer.Snapshots.save

    def save(self, step, *args, **kwargs):
        saves[step] = time.time()
        try:
            return original_save(self, step, *args, **kwargs)
        finally:
            returns[step] = time.time()

    original_write_json = writer.write_json_atomic

    def write_json_atomic(path, obj):
        result = original_write_json(path, obj)
        if os.path.basename(path) == MANIFEST:
            commits[step_of(path)] = time.time()
        return result

    original_put_json = store.Store.put_json

    def put_json(self, name, obj):
        result = original_put_json(self, name, obj)
        if name.endswith("/" + MANIFEST):
            commits[step_of(name)] = time.time()
        return result

    writer.Snapshots.save = save
    writer.write_json_atomic = write_json_atomic
    store.Store.put_json = put_json

    def dump():
        times = os.times()
        record = {{"saves": saves, "returns": returns, "commits": commits, "cpu_s": times.user + times.system}}
        with open(os.path.join(os.environ["STORE_BENCH_OUT"], f"events-rank{{os.environ['RANK']}}.json"), "w") as f:
            json.dump(record, f)

    atexit.register(dump)
    warmstart.run_and_exit(lambda: train.main(sys.argv[1:]))
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_moto(log_file):
    """moto's S3 server; its request log (one line a request) goes to `log_file`."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=open(log_file, "w"),
    )

    def listening():
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, 60, "moto's S3 server", poll=0.1)
    return server, f"http://127.0.0.1:{port}"


def requests(log_file):
    """{method: count} of the requests moto's server logged so far."""
    counts = {}
    for line in Path(log_file).read_text(errors="replace").splitlines():
        for method in ("GET", "PUT", "POST", "HEAD", "DELETE"):
            if f'"{method} ' in line:
                counts[method] = counts.get(method, 0) + 1
    return counts


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def one_run(project, work, model, case, steps, index, store):
    """One job of 2 ranks; its step times, time in save(), commit latencies and what the store's server did."""
    args, every, _ = MODELS[model]
    folder = work / f"{model}-{case}-{index}"
    folder.mkdir()
    target = f"s3://{store['bucket']}/run-{model}-{index}" if case == "store" else str(folder / "snapshots")
    every = steps if case == "none" else every
    args = [
        *args,
        *("--max-steps", steps, "--snapshot-every", every, "--snapshot-dir", target),
        *("--dataset-size", 65536, "--val-size", 0, "--threads-per-rank", 1, "--wandb", "disabled"),
    ]
    server = store["server"]
    moto_cpu, moto_requests = cpu_seconds(server.pid), requests(store["log"])
    env = {**store["env"], "STORE_BENCH_OUT": folder}
    run = Run(project / "store_measure.py", args, 2, folder, env_extra=env)
    code = run.wait(1800)
    exited = time.time()
    text = run.text()
    if code != 0:
        raise RuntimeError(f"{model} {case} run {index} failed ({code}):\n{text[-3000:]}")
    after = requests(store["log"])
    result = {"model": model, "case": case, "index": index, "every": every, "steps": steps}
    result["moto_cpu_s"] = cpu_seconds(server.pid) - moto_cpu
    result["requests"] = {k: v - moto_requests.get(k, 0) for k, v in after.items() if v > moto_requests.get(k, 0)}
    gaps = []
    for rank in (0, 1):
        times = run.step_times(rank)
        gaps += [b - a for a, b in zip(times[WARMUP:-1], times[WARMUP + 1 :], strict=True)]
        if rank == 0:
            result["steps_per_s"] = (len(times) - 1 - WARMUP) / (times[-1] - times[WARMUP])
    result["step_ms"] = {"median": 1000 * statistics.median(gaps), "p90": 1000 * percentile(gaps, 0.9)}
    result["warnings"] = [line for line in text.splitlines() if " WARNING " in line]
    events = json.loads((folder / "events-rank0.json").read_text())
    saves, returns, commits = ({int(k): v for k, v in events[key].items()} for key in ("saves", "returns", "commits"))
    result["saves"], result["committed"] = len(saves), len(set(commits) & set(saves))
    result["ranks_cpu_s"] = events["cpu_s"] + json.loads((folder / "events-rank1.json").read_text())["cpu_s"]
    last = max(saves)
    result["last_step_to_exit_s"] = exited - saves[last]
    if case != "none":
        timed = [s for s in sorted(saves) if s > WARMUP and s != last]
        result["in_save_ms"] = [1000 * (returns[s] - saves[s]) for s in timed]
        result["latency_s"] = [commits[s] - saves[s] for s in sorted(saves) if s in commits]
        result["latency_steps"] = [s for s in sorted(saves) if s in commits]
        result["last_step_to_commit_s"] = commits[last] - saves[last] if last in commits else None
    if case == "local":
        newest = sorted((folder / "snapshots").glob("step-*"))[-1]
        result["snapshot_bytes"] = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file())
    shutil.rmtree(folder, ignore_errors=True)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=0, help="steps of every run (default: each model's own)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--models", default="small,large")
    parser.add_argument("--out", default=str(BENCH / "STORE.md"))
    parser.add_argument("--report-only", action="store_true", help="write --out again from its .json, run nothing")
    options = parser.parse_args()
    if options.report_only:
        write_report(Path(options.out), json.loads(Path(options.out).with_suffix(".json").read_text()))
        return

    import boto3

    info = machine()
    info["load_before"] = load()
    meter = CpuMeter()
    work = scratch_dir("store-overhead-")
    log_file = work / "moto.log"
    server, endpoint = start_moto(log_file)
    env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
    os.environ.update(env)
    store = {"server": server, "log": log_file, "env": env, "bucket": f"bench{random.randrange(1 << 32):x}"}
    boto3.client("s3").create_bucket(Bucket=store["bucket"])
    rows = []
    try:
        project, package = bake(work / "bake")
        (project / "store_measure.py").write_text(WRAPPER.format(package=package))
        for model in options.models.split(","):
            steps = options.steps or MODELS[model][2]
            for index in range(options.repeats):
                for case in CASES:
                    row = one_run(project, work, model, case, steps, index, store)
                    row["load_after"] = load()[0]
                    rows.append(row)
                    latency = row.get("latency_s")
                    print(
                        f"{model} {case} #{index}: step median {row['step_ms']['median']:.1f} ms, p90 "
                        f"{row['step_ms']['p90']:.1f} ms, {row['steps_per_s']:.1f} steps/s"
                        + (
                            f"; commit median {statistics.median(latency):.2f} s, max {max(latency):.2f} s"
                            if latency
                            else ""
                        )
                        + f"; last step to exit {row['last_step_to_exit_s']:.1f} s; moto {row['moto_cpu_s']:.1f} s "
                        f"CPU; load {row['load_after']:.2f}",
                        flush=True,
                    )
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    info.update(meter.stop())
    info["load_end"] = load()
    result = {"machine": info, "options": vars(options), "rows": rows}
    Path(options.out).with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    write_report(Path(options.out), result)
    print(f"wrote {options.out}")


READING = [
    "How to read it:",
    "",
    "- The training thread does not wait for the store: its time in save() is the same as with a folder (it waits "
    "for the previous save's write to the local staging folder, as a folder run waits for its write). What slows "
    "the steps is the CPU the uploads take on a machine with no core to spare: the ranks' own (s3fs sends each "
    "object and reads it back to check its sha256) and, here only, moto's.",
    "- One snapshot is staged and uploaded at a time. A snapshot step that comes while the one before is still "
    "being staged or uploaded is skipped on every rank (one WARNING; `committed / saved` counts the snapshots "
    "saved): no queue builds up on disk, the time to commit stays flat through the run (first 10% against last "
    "10%), and the end of the run waits for one upload at most (last step to job exit).",
    "- For a small snapshot an upload costs requests, not bytes (each rank's objects are put and read back, rank 0 "
    "waits for the other ranks' receipts, checks every object's size, writes the manifest and the run's files, "
    "then lists the prefix and reads the kept manifests to prune).",
]


def joined(runs, key):
    """Each run's value of `key`, one decimal, comma-separated."""
    return ", ".join(f"{row[key]:.1f}" for row in runs)


def write_report(out, result):
    info, options, rows = result["machine"], result["options"], result["rows"]
    command = "python bench/store_overhead.py" + (f" --steps {options['steps']}" if options["steps"] else "")
    command += f" --repeats {options['repeats']} --models {options['models']}"
    lines = [
        "# Snapshots on an S3 store: what they cost the steps, and how long a snapshot takes to commit",
        "",
        f"Measured {info['date']} on {info['cpu']}, {info['nproc']} cores, torch {info['torch']}, Python "
        f"{info['python']}; 1-minute load {info['load_before'][0]:.2f} at the start, {info['load_end'][0]:.2f} at "
        f"the end; other processes used {info['foreign_cpu_s']:.0f} s "
        f"of CPU in {info['wall_s']:.0f} s. Command: `{command}` (bakes the template; `$(scripts/setup-env.sh)` "
        "gives the interpreter).",
        "",
        "2 CPU ranks (gloo, one thread each), the demo MLP at batch 64. `none`: only the final snapshot, after the "
        "last timed step; `local`: a folder under the system's temp dir; `store`: s3://bucket/run-N on moto's S3 "
        "server on 127.0.0.1, which runs on the same 2 cores (its CPU seconds are in the table; a real store's are "
        f"not yours). Step: the gap between optimizer steps on each rank after step {WARMUP} (one step and the "
        "snapshot saved after it), both ranks, the last step left out; median and p90 of every run's gaps, "
        "pooled. Steps/s: rank 0's mean over the same window. In save(): how long the training thread spent in "
        "Snapshots.save() (it waits for the previous save's local write, then writes its own small part). CPU: "
        "user + system seconds of both ranks over the whole run (start-up and the final wait included).",
        "",
        "| model | every | snapshots to | step median ms | step p90 ms | steps/s | vs none | vs local | "
        "in save() median ms | ranks' CPU s per run | moto CPU s per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups = {}
    for row in rows:
        groups.setdefault((row["model"], row["case"]), []).append(row)
    sizes = {row["model"]: row["snapshot_bytes"] for row in rows if "snapshot_bytes" in row}

    def rate(model, case):
        return statistics.median(row["steps_per_s"] for row in groups[(model, case)])

    for (model, case), runs in groups.items():
        gaps_median = statistics.median(row["step_ms"]["median"] for row in runs)
        gaps_p90 = statistics.median(row["step_ms"]["p90"] for row in runs)
        every = runs[0]["every"] if case != "none" else "-"
        in_save = [ms for row in runs for ms in row.get("in_save_ms", [])]
        against_local = f"{rate(model, case) / rate(model, 'local'):.2f}" if case == "store" else ""
        lines.append(
            f"| {model} ({sizes.get(model, 0) / 1e6:.1f} MB a snapshot) | {every} | {case} | {gaps_median:.1f} | "
            f"{gaps_p90:.1f} | {rate(model, case):.1f} "
            f"({joined(runs, 'steps_per_s')}) | "
            f"{rate(model, case) / rate(model, 'none'):.2f} | {against_local} | "
            f"{statistics.median(in_save) if in_save else float('nan'):.1f} | {joined(runs, 'ranks_cpu_s')} | "
            f"{joined(runs, 'moto_cpu_s') if case == 'store' else ''} |"
        )
    lines += [
        "",
        "From a snapshot step to its commit: from the training thread's call of save() for that step to the end of "
        "the manifest's write (a folder: the manifest file renamed into place; the store: the manifest object "
        "written), on rank 0, every snapshot of the run; pooled over the runs. Requests: what moto's server logged "
        "per snapshot, both ranks together.",
        "",
        "| model | every | snapshots to | committed / saved | to commit: median s | p90 s | max s | "
        "first 10% median s | last 10% median s | last step to job exit s | requests per snapshot |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (model, case), runs in groups.items():
        if case == "none":
            continue
        latency = [x for row in runs for x in row["latency_s"]]
        tenth = [max(1, len(row["latency_s"]) // 10) for row in runs]
        first = [x for row, n in zip(runs, tenth, strict=True) for x in row["latency_s"][:n]]
        final = [x for row, n in zip(runs, tenth, strict=True) for x in row["latency_s"][-n:]]
        saved = sum(row["saves"] for row in runs)
        per = sum(sum(row["requests"].values()) for row in runs) / saved
        lines.append(
            f"| {model} | {runs[0]['every']} | {case} | {sum(row['committed'] for row in runs)} / {saved} | "
            f"{statistics.median(latency):.2f} | {percentile(latency, 0.9):.2f} | {max(latency):.2f} | "
            f"{statistics.median(first):.2f} | {statistics.median(final):.2f} | "
            f"{joined(runs, 'last_step_to_exit_s')} | "
            f"{per:.0f} |"
        )
    warnings = sorted(
        {line.split(" WARNING ", 1)[1].split(": ", 1)[-1][:90] for row in rows for line in row["warnings"]}
    )
    lines += ["", "WARNINGs the runs printed (each rank's, first 90 characters): "]
    lines += [f"- `{w}`" for w in warnings] or ["- none"]
    lines += ["", *READING, "", "Every figure, each run's load and every commit latency: STORE.json.", ""]
    out.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
