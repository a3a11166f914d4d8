"""Snapshots: everything needed to continue a run, written in the background, checked, committed once complete.

Layout of the snapshot folder (one job per folder; on several machines it must be a shared folder):

    job.lock                   held by rank 0 of the job training into the folder (see joblock.py)
    run.json                   the run id (wandb; see tracking.run_id), kept by every restart and re-launch
    step-00000100/             one snapshot, taken after 100 optimizer steps
        shared.pt              the run's shared parts: model, optimizer, scheduler, scaler, progress and data
                               position, any part the trainer registers, and the config (rank 0 writes it)
        rank-00000.pt          one rank's own parts: its random streams, its place in a stream (each rank
                               writes its own, at the snapshot step, before its next step)
        rank-00000.json        that rank's receipt: size and sha256 of what it wrote, the number of ranks, the job
        sharded/               --strategy fsdp only: model and optimizer, each rank's shards written by
                               torch.distributed.checkpoint (__<rank>_0.distcp; rank 0 adds .metadata)
        manifest.json          the commit marker, written last by rank 0 once every receipt is in; "frozen_in"
                               names the step whose snapshot holds the model's frozen parameters, when another
                               one does (they are written once, not in every snapshot: see frozen.py)

Every file is written to a temporary name, fsynced and renamed. A step folder without manifest.json is an
interrupted save, never loaded: the next start commits it when every receipt is there and every file checks out,
and removes it otherwise. A snapshot whose manifest or files do not check out is skipped with a warning; all ranks
resume from the same one. Only folders named exactly as step_name() names them are snapshots.

A fresh start (`--resume never`) moves what the folder holds aside into `<folder>.set-aside-<date>-<time>` (for a
symbolic link, the folder it points to), unless this same torchrun job wrote the snapshots: that is a restart. On
a store, each object is copied to `<prefix>.set-aside-<date>-<time>`, checked, then removed; `set-aside.json` on the
prefix records a move in progress, which the next start finishes (store.py).

Where the code is: format.py (names, checksummed writes, the manifest, checked reads), rng.py, staging.py (copies
off the training thread), folder.py (prepare, resume, set aside, prune), writer.py (`Snapshots`: save and commit),
store.py (the same on object storage; `load_latest` of a folder or a store).
"""

from .format import (
    MANIFEST,
    RUN_FILE,
    SHARED,
    SnapshotError,
    list_steps,
    manifest_digest,
    rank_file,
    read_manifest,
    sharded_keys,
    step_name,
    write_atomic,
    write_json_atomic,
)
from .rng import OwnStreams, capture_rng, restore_rng
from .store import load_latest
from .writer import Snapshots

__all__ = [
    "MANIFEST",
    "RUN_FILE",
    "OwnStreams",
    "SHARED",
    "SnapshotError",
    "Snapshots",
    "capture_rng",
    "list_steps",
    "load_latest",
    "manifest_digest",
    "rank_file",
    "read_manifest",
    "restore_rng",
    "sharded_keys",
    "step_name",
    "write_atomic",
    "write_json_atomic",
]
