"""Streaming training sets: torchdata's StatefulDataLoader against a hand-written skip-count resume.

Run: PYTHONPATH=<folder with torchdata 0.11> .venv/bin/python bench/stream_resume.py [--quick]
(for instance `pip install --no-deps --target /tmp/td torchdata==0.11.0`). CPU only, about 2-3 minutes on 2 cores.

It measures, for one rank of a 2-rank job (batch 8, rank r taking items r, r+2, ...):
- exactness: the batches after a resume from a snapshot (saved with torch.save, loaded with weights_only=True)
  equal, bitwise, those of an uninterrupted run, with 0 and 2 workers, with and without a dataset state_dict,
  with persistent workers, and with a snapshot taken while the workers have prefetched batches ahead;
- the resume cost: seconds from loading the snapshot to the first batch, after N consumed items, for a cheap
  item and for one that costs 20 us to produce;
- the per-batch cost against a plain DataLoader, and the import time torchdata adds.
"""

import gc
import io
import itertools
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

warnings.filterwarnings("ignore")  # torchdata calls the deprecated torch.set_vital; naive fast-forward warns
sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_torchdata import StreamLoader  # noqa: E402  (the torchdata variant measured here)
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

WORLD, RANK, BATCH = 2, 1, 8
QUICK = "--quick" in sys.argv


def _item(i, cost_us):
    if cost_us:  # stand-in for decoding / tokenizing
        end = time.perf_counter() + cost_us * 1e-6
        while time.perf_counter() < end:
            pass
    return {"x": torch.arange(i % 7 + 1, dtype=torch.float32) + i, "y": torch.tensor(i)}


class Stream(IterableDataset):
    def __init__(self, n, cost_us=0):
        self.n, self.cost_us = n, cost_us

    def __iter__(self):
        return (_item(i, self.cost_us) for i in range(self.n))


class StatefulStream(Stream):
    def __init__(self, n, cost_us=0):
        super().__init__(n, cost_us)
        self.pos = 0

    def __iter__(self):
        for i in range(self.pos, self.n):
            self.pos = i + 1
            yield _item(i, self.cost_us)

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def collate(items):
    return {
        "x": torch.nn.utils.rnn.pad_sequence([t["x"] for t in items], batch_first=True),
        "y": torch.stack([t["y"] for t in items]),
    }


# ------------------------------------------------------------------ the hand-written alternative


class SkipShare(IterableDataset):
    """The rank's share from share-batch `start` on, batch b (counted from start) to worker b % W."""

    def __init__(self, dataset, rank, world, batch, start=0):
        self.dataset, self.rank, self.world, self.batch, self.start = dataset, rank, world, batch, start

    def __iter__(self):
        info = get_worker_info()
        w, W = (info.id, info.num_workers) if info else (0, 1)
        first = self.start * self.batch * self.world  # the first stream item of share-batch `start`
        for index, item in enumerate(itertools.islice(iter(self.dataset), first, None), first):
            b = index // self.world // self.batch - self.start
            if index % self.world == self.rank and b % W == w:
                yield item


class SkipLoader:
    """A plain DataLoader and a count of the batches it has handed out; the resume skips that many."""

    def __init__(self, make, num_workers, persistent=False, start=0):
        self.make, self.num_workers, self.persistent, self.batches = make, num_workers, persistent, start
        self.loader = DataLoader(
            SkipShare(make(), RANK, WORLD, BATCH, start),
            batch_size=BATCH,
            drop_last=True,
            collate_fn=collate,
            num_workers=num_workers,
            persistent_workers=persistent,
            generator=torch.Generator().manual_seed(RANK),
        )
        self.it = iter(self.loader)

    def next(self):
        self.batches += 1
        return next(self.it)

    def state_dict(self):
        return {"batches": self.batches}

    def close(self):
        pass

    @classmethod
    def resumed(cls, make, num_workers, state, persistent=False):
        return cls(make, num_workers, persistent, start=state["batches"])


# ------------------------------------------------------------------ the torchdata candidate


class TorchdataLoader:
    """The torchdata variant (RankShare in a StatefulDataLoader, bench/stream_torchdata.py), or, with wrap=False,
    a StatefulDataLoader on its own over SkipShare: what torchdata does for a dataset without state (re-yield the
    batches and drop them)."""

    def __init__(self, make, num_workers, persistent=False, wrap=True, state=None):
        if wrap:
            self.inner = StreamLoader(
                make(), RANK, WORLD, BATCH, num_workers, collate, 0, torch.Generator(), persistent_workers=persistent
            )
            if state is not None:
                self.inner.load_state_dict(state)
            self.next = lambda: self.inner.next_step(1)[0]
            self.state_dict = self.inner.state_dict
        else:
            self.loader = StatefulDataLoader(
                SkipShare(make(), RANK, WORLD, BATCH),
                batch_size=BATCH,
                drop_last=True,
                collate_fn=collate,
                num_workers=num_workers,
                persistent_workers=persistent,
                generator=torch.Generator().manual_seed(RANK),
            )
            if state is not None:
                self.loader.load_state_dict(state)
            self.it = it = iter(self.loader)
            self.next = lambda: next(it)
            self.state_dict = self.loader.state_dict

    @classmethod
    def resumed(cls, make, num_workers, state, persistent=False, wrap=True):
        return cls(make, num_workers, persistent, wrap, state)

    def close(self):
        """Kill the workers, as SIGKILL would: dropping a StatefulDataLoader iterator mid-stream otherwise
        waits 5 s per worker for them to join (measured below), which would dominate this benchmark."""
        it = self.inner._iterator if hasattr(self, "inner") else self.it
        for worker in getattr(it, "_workers", []):
            worker.terminate()


def roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def same(a, b):
    return all(torch.equal(x["x"], y["x"]) and torch.equal(x["y"], y["y"]) for x, y in zip(a, b, strict=True))


def collected(fn):
    """Loaders that hold lambdas over themselves are cycles: free their workers before the next forks."""

    def run(*args, **kw):
        gc.collect()
        try:
            return fn(*args, **kw)
        finally:
            gc.collect()

    return run


@collected
def exact(kind, make, num_workers, persistent=False, total=40, cut=17, **kw):
    full = kind(make, num_workers, persistent, **kw)
    reference = [full.next() for _ in range(total)]
    first = kind(make, num_workers, persistent, **kw)
    head = [first.next() for _ in range(cut)]
    time.sleep(0.2)  # let the workers prefetch ahead of the snapshot
    state = roundtrip(first.state_dict())
    first.close()
    resumed = kind.resumed(make, num_workers, state, persistent, **kw)
    tail = [resumed.next() for _ in range(total - cut)]
    full.close(), resumed.close()
    expected = list(range(RANK, RANK + WORLD * total * BATCH, WORLD))
    return same(reference, head + tail) and torch.cat([b["y"] for b in reference]).tolist() == expected


@collected
def resume_cost(kind, make, num_workers, consumed_batches, **kw):
    state = {"batches": consumed_batches} if kind is SkipLoader else None
    if state is None:  # reach the position once, untimed, to get a real snapshot
        first = kind(make, num_workers, **kw)
        for _ in range(consumed_batches):
            first.next()
        state = roundtrip(first.state_dict())
        first.close()
    started = time.perf_counter()
    resumed = kind.resumed(make, num_workers, state, **kw)
    resumed.next()
    seconds = time.perf_counter() - started
    resumed.close()
    return seconds


@collected
def per_batch(kind, make, num_workers, batches, **kw):
    loader = kind(make, num_workers, **kw)
    loader.next()  # worker start-up is not per batch
    started = time.perf_counter()
    for _ in range(batches):
        loader.next()
    seconds = time.perf_counter() - started
    loader.close()
    return seconds / batches * 1e6


@collected
def shutdown_seconds(num_workers=2):
    """What dropping a loader mid-stream costs (the end of a run, a stop request)."""
    out = {}
    for name, kind in (("plain_dataloader_s", SkipLoader), ("torchdata_s", TorchdataLoader)):
        loader = kind(lambda: Stream(10**7), num_workers)
        loader.next()
        started = time.perf_counter()
        del loader
        gc.collect()
        out[name] = time.perf_counter() - started
    return out


def import_seconds():
    code = (
        "import sys, time, torch; before = set(sys.modules); t = time.perf_counter();"
        "from torchdata.stateful_dataloader import StatefulDataLoader;"
        "print(time.perf_counter() - t);"
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))"
    )
    runs = [
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
        for _ in range(3)
    ]
    return min(float(r[0]) for r in runs), runs[0][1]


def main():
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "python": sys.version.split()[0]}
    import torchdata

    results["torchdata"] = torchdata.__version__
    n = 10**7
    plain, stateful = (lambda: Stream(n)), (lambda: StatefulStream(n))
    rows = []
    for name, kind, kw in (
        ("torchdata + RankShare", TorchdataLoader, {}),
        ("torchdata alone (fast-forward)", TorchdataLoader, {"wrap": False}),
        ("hand-written skip", SkipLoader, {}),
    ):
        for num_workers in (0, 2):
            for data_name, make in (("no state_dict", plain), ("state_dict", stateful)):
                ok = exact(kind, make, num_workers, **kw)
                persistent = exact(kind, make, num_workers, persistent=True, **kw) if num_workers else None
                rows.append(
                    {
                        "loader": name,
                        "workers": num_workers,
                        "dataset": data_name,
                        "exact": ok,
                        "exact_persistent": persistent,
                    }
                )
                print(rows[-1], flush=True)
    results["exact"] = rows

    consumed = 300 if QUICK else 1_500  # batches of 8 for this rank, so 2 * 8 * consumed stream items
    costs = []
    for cost_us in (0, 20):
        for num_workers in (0, 2):
            row = {"item_cost_us": cost_us, "workers": num_workers, "consumed_items": consumed * BATCH * WORLD}
            if cost_us and QUICK:
                continue
            row["skip_s"] = resume_cost(SkipLoader, lambda c=cost_us: Stream(n, c), num_workers, consumed)
            row["torchdata_skip_s"] = resume_cost(
                TorchdataLoader, lambda c=cost_us: Stream(n, c), num_workers, consumed
            )
            row["torchdata_fast_forward_s"] = resume_cost(
                TorchdataLoader, lambda c=cost_us: Stream(n, c), num_workers, consumed, wrap=False
            )
            row["torchdata_state_dict_s"] = resume_cost(
                TorchdataLoader, lambda c=cost_us: StatefulStream(n, c), num_workers, consumed
            )
            costs.append(row)
            print(row, flush=True)
    results["resume"] = costs

    overhead = []
    for num_workers in (0, 2):
        batches = 200 if QUICK else 1000
        row = {
            "workers": num_workers,
            "plain_dataloader_us": per_batch(SkipLoader, plain, num_workers, batches),
            "torchdata_us": per_batch(TorchdataLoader, plain, num_workers, batches),
            "torchdata_dataset_state_us": per_batch(TorchdataLoader, stateful, num_workers, batches),
        }
        overhead.append(row)
        print(row, flush=True)
    results["per_batch"] = overhead
    results["shutdown_2_workers"] = shutdown_seconds()
    print("shutdown", results["shutdown_2_workers"], flush=True)
    results["import_s"], results["import_modules"] = import_seconds()
    print("import", results["import_s"], results["import_modules"])
    out = Path(__file__).with_name("STREAMS.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
