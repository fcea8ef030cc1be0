"""How a run ends early, as `gyre.run` tells torchrun (docs/design.md §1).

    RunFailed     the run stopped early; the message is written for the user and has already
                  been logged once, by the controller (rank 0 exits 1)
    RunStopped    on another rank: the controller stopped the run after a failure it reported
                  (the rank exits 0, so torchrun's report names rank 0 alone)
    WorkerFailed  this rank raised while handling a command; it logged the traceback and told
                  the controller (the rank exits 1)
"""


class RunFailed(RuntimeError):
    """The run stopped early; the message says what to look at."""


class RunStopped(RunFailed):
    """Another rank's failure stopped this rank; rank 0 reports why."""


class WorkerFailed(RunFailed):
    """This rank raised while handling a command; its traceback is in its log."""
