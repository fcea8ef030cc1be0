"""The run time of a training job (docs/design.md §1–3): what every rank runs, how rank 0 drives it,
what the run leaves behind.

    job.py          the per-rank job (`--job train`): build the parts through the backend
                    factory, then follow the controller's commands
    controller.py   rank 0, own thread + asyncio loop: events in → ledger entries and scheduler
                    calls (gyre.scheduler.ElasticScheduler) → commands out
    proxy_access.py the data plane's start on rank 0 (proxy, engines, harness runner) and the
                    runner's access to the proxy
    stop.py         the end of every run, one ordered sequence
    writes.py       every failed write (results, TITO, metrics, journal) → one error the run stops on
    worker.py       every rank: the cell's state machine, its rollout engine and training actor,
                    one handler per command
    messages.py     the typed controller ⇄ worker protocol (commands, reports), drawn once
    control.py      mailboxes and blobs over torchrun's store
    cell.py         the cell state machine and the one function that turns transitions into a timeline
    ledger.py       one record per dispatched group, per execution (calls, sink errors, outcome,
                    reward, incomplete TITO) and per optimizer step; the cell timeline
    summary.py      each step's metrics.jsonl row and summary.json, from the ledger and named sources
    samples.py      a finished group → micro-step bundles (trees, selection, advantages, packing)
    outputs.py      metrics.jsonl, the role-timeline PNG, the reward trend, the TensorBoard / wandb trackers
    rundir.py       one directory per run: runs/<preset>/<timestamp>, latest, resume / overwrite;
                    attempts, groups.jsonl, carry-over of earlier attempts' evaluated groups
    runlock.py      run_dir/run.lock: one job at a time in a run directory (rank 0's flock)
    peers.py        every rank's process in run.json; which ones died, named as an attempt's cause

`gyre/report.py` (`python -m gyre.report RUN_DIR`) renders what a run wrote; checkpoints are
`gyre/checkpoint.py` (a storage format the backends read and write too, so it lives below them). Parameters move through the run's `WeightTransport`
(`gyre.backends.factory`, `--transfer.*`).
"""
