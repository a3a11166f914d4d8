"""The template's machinery: training, snapshots, logging, debugging. Edit it only if you mean to.

Your rooms are one level up: model.py, data.py and config.py (the seam: machinery/hooks.py lists every hook).

    trainer.py      the loop (`train()`) and the `Trainer` that puts the rooms below together
    startup.py      a run's start: its parts built from the hooks, restored from the newest good snapshot
    checkpointer.py when the run saves a snapshot (--snapshot-every, the last step), of a finite state only
    ending.py       a run's end: final snapshot, stop record, exported weights, summary
    hooks.py        the seam: the hooks of model.py and data.py, their defaults, the start-up check
    batches.py      progress, run length in samples, map-style data one optimizer step at a time
    stream.py       streaming data (IterableDataset): each rank's share, resumable
    parallel.py     the model across the ranks: DDP or FSDP2, mixed precision, torch.compile
    checkpointing.py --activation-checkpointing: the units recompute their forward in backward
    step.py         one optimizer step: forward/backward over micro-batches, the loss reduction, clip, step
    optim.py        the default optimizer and learning-rate schedule, and how they resume
    evaluate.py     exact evaluation over every rank, at --eval-every; the best weights exported
    state.py        what a snapshot holds: named parts with state_dict()/load_state_dict()
    pretrained.py   pretrained_weights: the starting weights read once, one tensor at a time (fsdp: built on meta)
    writeonce.py    write_once: a cache folder (prepare_data's) made once, safe for jobs that make it at once
    frozen.py       frozen parameters (a LoRA model's base): written once per run, checked before each save
    snapshot/       snapshots on disk or a store (s3://...): format, staging copies, the folder, the writer; load_latest
    report.py       export, summary, the resolved settings, the progress bar
    stop.py         SIGTERM and Ctrl-C: stop every rank at the same step, with a snapshot
    runsettings.py  the engine's settings (RunSettings, which config.py's Config extends), grouped as --help shows
    settings.py     the settings dataclass <-> command line and TOML
    storeurl.py     how a store URL (s3://bucket/prefix) must be spelled: one spelling per prefix
    distributed.py  the torchrun environment, process group, device and teardown
    launcher.py     launch(): torchrun's elastic agent started from Python (notebooks, scripts), output in the caller
    sweeps.py       an Optuna study whose trials are multi-rank runs, each in a folder (python -m <package>.sweep)
    trialreport.py  a trial of a sweep: rank 0 reports its metric to the study; a pruned trial stops every rank
    partners.py     the hooks through which jobs that train one model together meet in the loop (none by default)
{%- if cookiecutter.replica_groups == "yes" %}
    replicas.py     --fault-tolerance torchft: replica groups that train on while a failed one restarts (torchft)
{%- endif %}
    logs.py         rank-aware logging (one clean console, every rank's warnings)
    faults.py       an error in your code, in one line naming your function and line, on the rank it happened on
    tracking.py     experiment tracking (wandb on rank 0, the metrics file), the run id, the logged metrics
    measure.py      what steps cost: tokens/s, peak memory and mfu per logged step; each rank's step time by part
    outputs.py      the files beside the snapshots belong to one run: path checks at start-up, the export folder
    joblock.py      one job per snapshot folder
    parentdeath.py  workers that do not outlive their torchrun agent
    identity.py     which process is which under torchrun: the job, the worker and its agent, a pid's start time
    warmstart.py    torchrun's restarts without importing torch again: each restarted rank runs in a fork of a
                    process the job's first attempt left with torch imported (or of a standing one: serve_pool)
    processexit.py  a rank's exit: as the interpreter's, without its last garbage collection (a second per rank)
    watchdog.py     a hung rank's stacks, before the collective timeout
    debug.py        attach a debugger to chosen ranks (DEBUG_RANK)
    nonfinite.py    a NaN or infinite loss or gradient: the check at logs and snapshots, the replay naming its origin
    debugflags.py   --break-at-step, --profile-steps, --check-replicas: hooks at the start and end of a step
    plot.py         loss curves from the metrics file (python -m <package>.machinery.plot)
    baked.py        the answers the project was generated with
"""
