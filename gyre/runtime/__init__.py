"""The run-time of a training job: the controller on rank 0 and a cell worker on every rank.

    controller.py   rank 0, own thread + asyncio loop: proxy, harness runner, scheduler
                    (gyre.scheduler.ElasticScheduler), groups → micro-steps, commands to cells
    worker.py       every rank: the cell state machine, its rollout engine and training actor,
                    executing the controller's commands (the loop is in gyre.train)
    engine_host.py  a rollout engine served over HTTP from a background thread
    samples.py      a finished group → micro-step bundles (trees, selection, advantages, packing)

Messages travel through `gyre.control` (torchrun's store); parameters through the run's
`WeightTransport` (`--transfer.transport`): one-sided reads of the core's snapshots and
broadcasts over the prebuilt prefix groups.
"""
