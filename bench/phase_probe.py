"""Each phase's own peak memory in one rank: what memory_phases.py's wrapper and bare_fsdp.py record.

`Phases.enter(name)` ends the phase in progress and starts `name`. At each boundary the phase that ends is given the
process's peak resident memory since it started (VmHWM in /proc/self/status) and its resident memory at its end
(VmRSS), then the peak is reset to the memory resident now (writing "5" to /proc/self/clear_refs, Linux 4.0+), so
each phase's figure is its own peak. A phase entered more than once (the training steps between snapshots) keeps
its largest peak. The phases tile the run, so the largest phase peak is the peak of the whole run. On CUDA the
same is read from torch.cuda.max_memory_allocated and max_memory_reserved (reset with reset_peak_memory_stats).
"""

import json
import os
import time


def _status_mib() -> dict:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")


class Phases:
    def __init__(self, first: str = "startup"):
        self.current = first
        self.order: list[str] = [first]
        self.peak: dict[str, float] = {}  # VmHWM during the phase, MiB (its largest over its visits)
        self.rss_end: dict[str, float] = {}  # VmRSS at the end of its first visit
        self.anon_end: dict[str, float] = {}
        self.cuda_allocated: dict[str, float] = {}
        self.cuda_reserved: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # time spent in the phase, every visit
        self._since = time.perf_counter()

    def enter(self, name: str) -> None:
        if name == self.current:
            return
        status = _status_mib()
        ended = self.current
        now = time.perf_counter()
        self.seconds[ended] = self.seconds.get(ended, 0.0) + now - self._since
        self._since = now
        self.peak[ended] = max(self.peak.get(ended, 0.0), status["VmHWM"])
        self.rss_end.setdefault(ended, status["VmRSS"])
        self.anon_end.setdefault(ended, status["RssAnon"])
        _reset_peak()
        self._cuda(ended)
        self.current = name
        if name not in self.order:
            self.order.append(name)

    def _cuda(self, ended: str) -> None:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
        mib = 2**20
        allocated, reserved = torch.cuda.max_memory_allocated() / mib, torch.cuda.max_memory_reserved() / mib
        self.cuda_allocated[ended] = max(self.cuda_allocated.get(ended, 0.0), allocated)
        self.cuda_reserved[ended] = max(self.cuda_reserved.get(ended, 0.0), reserved)
        torch.cuda.reset_peak_memory_stats()

    def dump(self, folder: str, **extra) -> None:
        """End the phase in progress and write this rank's record to <folder>/rank<N>.json."""
        self.enter("(end)")
        rank = int(os.environ.get("RANK", 0))
        record = {
            "rank": rank,
            "order": [name for name in self.order if name in self.peak],
            "peak_mib": self.peak,
            "rss_end_mib": self.rss_end,
            "anon_end_mib": self.anon_end,
            "cuda_max_allocated_mib": self.cuda_allocated,
            "cuda_max_reserved_mib": self.cuda_reserved,
            "seconds": self.seconds,
            **extra,
        }
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as handle:
            json.dump(record, handle)
