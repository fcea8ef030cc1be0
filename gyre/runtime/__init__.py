"""The run time of a training job (docs/design.md §1–3): what every rank runs, how rank 0 drives it,
what the run leaves behind. The job, the controller and the worker; their messages over the
control plane; the ledger, summaries and outputs; run directories, locks and the end of a run.
How to operate a run: docs/operations.md; the file map: docs/design.md §8.
"""
