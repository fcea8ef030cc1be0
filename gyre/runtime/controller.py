"""The controller: rank 0's own thread and asyncio loop (docs/design.md §1–3).

It uses the data plane (the proxy and the harness runner: `proxy_access.DataPlane`; by default
an execution-plane process, `gyre.runtime.plane_attach`) and drives
`gyre.scheduler.ElasticScheduler`. It only translates: reports in (one handler per type,
`HANDLERS`, protocol in `gyre.runtime.messages`), the runner's execution events, entries into the
run's ledger (`gyre.runtime.ledger`), scheduler decisions out as commands (`DECISIONS`):

    Dispatch(groups)        start N harness executions per group; an earlier attempt's group is
                            carried over instead: evaluated, or still running in the execution
                            plane and adopted (gyre.runtime.attempts)
    SwitchToTrain(cell)     drain the cell's engine in the proxy, then send the cell `ToTrain`
    OptimizerStep(step)     send `Reduce` to the decision's cells (0..k−1) with the step's groups
    SwitchToRollout(cell)   send the cell `ToRollout` with the published version
    Publish(version)        send every rollout engine `Load` of the version

Every answered command is watched (`ReplyWatch`). What the run writes is its `RunRecords`; how
it is ending, its `Ending`. Every end takes one ordered stop sequence (`gyre.runtime.stop.stop_run`),
which sees the controller only as `stop.Ranks` (`send_stop`, `pump_reports`, `check_silent`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gyre.config import TrainConfig
from gyre.errors import RunFailed
from gyre.executions.config import ExecutionsConfig
from gyre.executions.health import HealthMonitor
from gyre.executions.runner import EventKind, ExecutionEvent
from gyre.executions.tasks import Dataset
from gyre.runtime import attempts, stop
from gyre.runtime.control import CONTROLLER, ControlPlane, ReplyWatch
from gyre.runtime.ledger import RunLedger
from gyre.runtime.messages import (Command, Failed, Interrupted, Joined, Load, Loaded, Reduce, Report, RequestWork,
                                   RolledBack, StepDone, Stop, Stopped, ToRollout, ToTrain, TrainWork, Transition,
                                   WorkDone, handler_for)
from gyre.loss.config import LossConfig
from gyre.runtime.outputs import Trackers, read_metrics
from gyre.runtime.proxy_access import DataPlane
from gyre.runtime.records import RunRecords
from gyre.runtime.rundir import RunDir
from gyre.runtime.samples import audit_bundle, group_work, step_denominator, tito_records
from gyre.runtime.stop import Budget, Ending
from gyre.runtime.summary import Progress, RunEnd, build_summary, step_row
from gyre.runtime.writes import FirstError, watch_execution
from gyre.scheduler import (CellRole, Dispatch, ElasticScheduler, OptimizerStep, Publish, SwitchToRollout,
                            SwitchToTrain, SchedulerConfig, WallClock, Work)
from gyre.topology import Topology
from gyre.trajectory.store import TitoStore

logger = logging.getLogger(__name__)


class Controller:
    """Rank 0: `start()` once the engines are announced; `join()` waits (the end: `gyre.runtime.stop`)."""

    def __init__(self, topo: Topology, store: Any, run: RunDir, *, scheduler: SchedulerConfig, train: TrainConfig,
                 loss: LossConfig, executions: ExecutionsConfig, seed: int, data_plane: Callable[..., Any],
                 start_version: int = 0, trackers: Trackers | None = None, engine_secret: str | None = None,
                 interrupts: Any = None, records: RunRecords | None = None) -> None:
        """Everything that does not need the loop; each section of the config it reads is named.
        `run`: this attempt (`gyre.runtime.rundir`); `data_plane`: `proxy_access.start_data_plane`
        with the model, proxy and executions sections bound; `engine_secret`: the engines'
        (`engine_host.share_secret`); `interrupts`: this process's `control.Interrupts` (the stop
        budget runs from its first signal); `records`: what the run writes (default: built here)."""
        self.topo, self.store, self.engine_secret, self.data_plane = topo, store, engine_secret, data_plane
        self.scheduler_cfg, self.train_cfg, self.loss_cfg, self.seed = scheduler, train, loss, seed
        sc, tc = scheduler, train
        self.interrupts, self.ending = interrupts, Ending()
        self.budget = Budget(tc.drain_at_end_s, tc.shutdown_timeout_s, executions.runner.kill_grace_s)
        self.world_size, self.core_ranks = topo.world_size, frozenset(topo.cell_ranks(0))  # stop.Ranks
        self.run, self.run_dir = run, Path(run.path)
        self._thread = threading.Thread(target=self._main, name="gyre-controller", daemon=True)

        ds = executions.dataset
        if not ds.path:
            raise ValueError("executions.dataset.path is empty: give a JSONL of tasks (see examples/cpu_demo)")
        self.dataset = Dataset.from_jsonl(ds.path)
        # This launch's attempt: the groups earlier attempts lost come first, their evaluated
        # groups are carried over into the first dispatch slots (gyre.runtime.attempts).
        self.group_iter = attempts.attempt_groups(self.run.attempt, self.run.redo_tasks, self.dataset, sc.n_per_group,
                                                  shuffle=ds.shuffle, seed=seed + start_version)
        self.carried = attempts.carriable(self.run.carried, self.dataset, sc.n_per_group)
        self.sched = ElasticScheduler(sc, topo.num_cells, topo.num_pool_engines * sc.cell_concurrency,  # C_s
                                      clock=WallClock(), start_version=start_version)
        self.nominal = sc.batch_groups * sc.n_per_group  # B·N: the |E| every group is packed with (samples.py)
        hc = executions.health
        self.health = HealthMonitor(hc.window or self.nominal, hc.stop_fraction, hc.evaluator_window)
        self.ledger = RunLedger(topo.num_cells)
        self.writes = FirstError()  # the run's first write error (gyre.runtime.writes): stated once, stops it
        self.records = records or RunRecords(
            self.run, ledger=self.ledger, events=self.sched.log, summarize=self.summarize, on_error=self._error,
            fresh=not tc.resume, title=f"Gyre role timeline ({sc.mode})",
            trackers=trackers or Trackers([]))
        self.tito = TitoStore(self.run_dir / "tito")
        self.store_t = store.clone()  # the controller thread's own connection
        self.plane = ControlPlane(self.store_t, CONTROLLER)

        self.data: DataPlane | None = None  # the proxy and the harness runner: started by _run
        self.adopted: set[str] = set()  # earlier attempts' executions the execution plane still ran

        # Run state.
        self.pending: set[int] = set()  # cells that asked for work and got none yet
        self.last_step_t = 0.0  # set when the loop starts (the ledger's clock)
        self.watch = ReplyWatch()  # who owes a report (docs/design.md §1, the failure path)
        self._reporters = {topo.cell_ranks(c)[0] for c in range(topo.num_cells)} | {
            topo.pool_engine_ranks(e)[0] for e in range(topo.num_pool_engines)}
        self.progress = Progress(train.steps)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        """Wait for the controller; raise RunFailed (already reported in the log) if the run failed."""
        self._thread.join()
        if isinstance(e := self.ending.error, RunFailed):
            raise e
        if e is not None:
            raise RunFailed(f"the controller failed: {type(e).__name__}: {e}") from e

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(stop.quiet_cancelled)  # the stop's cancellations are no news
        try:
            loop.run_until_complete(self._run())
        except BaseException as e:  # surfaced by join(); the ranks must not hang meanwhile
            if isinstance(e, RunFailed):  # a diagnosis written for the user: no traceback
                logger.error("the run failed: %s", e)
            else:
                logger.exception("the run failed: the controller raised; stopping every rank")
            self.ending.fail(e)
            if not self.ending.stop_sent:
                stop.stop_every_rank(self.store, self.topo.world_size, checkpoint=self.ending.signal is not None)
        finally:
            self.records.trackers.close(failed=self.ending.error is not None)
            stop.close_loop(loop, timeout=3.0 if self.ending.signal else 30.0)  # an interrupt's stop is bounded

    # ------------------------------------------------------------------ set-up
    def _send_cell(self, cell: int, msg: Command) -> None:
        for r in self.topo.cell_ranks(cell):
            self._command(r, msg)

    def _command(self, rank: int, msg: Command) -> None:
        """Send `msg` to `rank`, noting the report it owes (`ReplyWatch`): `Stop` is answered by every
        rank, `Reduce` by the core, the others by a cell's (or pool engine's) first rank."""
        self.plane.send(rank, msg)
        owes = rank == self.topo.cell_ranks(0)[0] if isinstance(msg, Reduce) else rank in self._reporters
        if isinstance(msg, Stop) or owes:
            self.watch.expect(rank, type(msg), time.monotonic())

    # ------------------------------------------------------------------ stop.Ranks: what the stop sees
    def send_stop(self, rank: int, msg: Stop) -> None:
        self._command(rank, msg)

    def pump_reports(self) -> None:
        """Handle every queued report; one whose handling raises is the run's error (when it has
        none) and the next is handled: the run is already stopping."""
        while (msg := self.plane.try_recv()) is not None:
            try:
                self._on_message(msg)
            except Exception as e:  # noqa: BLE001
                self._error(e, f"handling {type(msg).__name__} from rank {msg.rank} during the stop")

    def check_silent(self) -> None:
        """Fail the run, naming the rank, when one owes a report and has said nothing for
        `train.control_timeout_s` (a frozen rank: its engine's calls are rerouted by the router)."""
        limit = self.train_cfg.control_timeout_s
        silent = self.watch.silent(time.monotonic(), limit) if limit > 0 else None
        if silent is None or self.ending.silent_rank is not None:
            return
        self.ending.silent_rank = silent[0]
        logger.error("%s", msg := stop.silent_error(*silent, limit))
        self.ending.fail(RunFailed(msg))

    def summarize(self, how: RunEnd, fractions: dict[int, float]) -> dict[str, Any]:
        """summary.json from the ledger and the live sources (`gyre.runtime.summary.build_summary`)."""
        try:
            rows = read_metrics(str(self.run_dir / "metrics.jsonl"))
        except OSError:
            rows = []
        return {**build_summary(self.ledger, how, scheduler=self.scheduler_cfg, shutdown_timeout_s=self.budget.shutdown_s,
                                seed=self.seed, fractions=fractions, router=self.data.router_stats(),
                                proxy_totals=self.data.totals(), worst_unmatched=self.data.worst_unmatched(10),
                                sink_errors=self.data.sink_errors(), health=self.health.counts,
                                measured_staleness=self.sched.staleness, run=self.run, rows=rows),
                "write_errors_after_the_first": self.writes.later}

    async def _run(self) -> None:
        self.data = await self.data_plane(
            self.run_dir, self.ledger, self.tito, self.store_t, self.topo, self.engine_secret,
            on_error=self._error, on_event=self._on_exec_event)
        self.ledger.begin(time.time())
        self.last_step_t = self.ledger.t_start

        self._apply(self.sched.start())
        next_tick = time.monotonic()
        try:
            while not self.ending.stopping:
                while (msg := self.plane.try_recv()) is not None:
                    self._on_message(msg)
                if time.monotonic() >= next_tick:
                    self._apply(self.sched.tick())
                    if line := self.progress.idle(self.sched, self.records.steps, time.monotonic()):
                        logger.info("%s", line)
                    self.check_silent()
                    next_tick = time.monotonic() + self.scheduler_cfg.tick_s
                self._serve_pending()
                await asyncio.sleep(0.003)
        except Exception as e:  # noqa: BLE001 - the stop sequence still runs (summary, events, ended)
            self._error(e, "the controller")
        await stop.stop_run(self, self.data, self.records, self.ending, self.budget, close=[("the data plane", self.data.close)])
        if self.ending.error is not None:
            raise self.ending.error

    def _spawn(self, coro) -> None:
        """Run `coro` on the loop; an exception in it fails the run instead of vanishing."""
        def done(task: asyncio.Task) -> None:
            if not task.cancelled() and task.exception() is not None:
                self._error(task.exception(), f"controller task {task.get_name()}")

        asyncio.get_running_loop().create_task(coro).add_done_callback(done)

    def _error(self, exc: BaseException, what: str, path: Any = None) -> None:
        """An error the run stops on (a failed write names its path and errno: `gyre.runtime.writes`);
        the first becomes the run's, stated once when the run ends."""
        err = self.writes.note(exc, what, path)
        if err is not None and self.ending.error is not None:  # already stopping for another reason: say it once
            logger.error("%s", err)
        self.ending.fail(err)

    # ------------------------------------------------------------------ decisions
    def _apply(self, decisions: list) -> None:
        for d in decisions:
            handler_for(self.DECISIONS, d, "controller (scheduler decisions)")(self, d)

    def _dispatch(self, d: Dispatch) -> None:
        if self.records.steps >= self.train_cfg.steps or self.ending.stopping:
            logger.info("not dispatching %d groups: the run is ending (%d steps done)", d.n_groups, self.records.steps)
            return
        for g in d.groups:
            if self.carried:  # evaluated in an earlier attempt: train it, do not run it again
                self._carry_over(g, self.carried.pop(0))
                continue
            group = next(self.group_iter)
            for spec in group.executions:
                spec.dispatch_version = d.version
            self.ledger.add_group(g, group, d.version)
            self.records.journal.dispatched(group.group_id, group.task.task_id, d.version,
                                    [e.execution_id for e in group.executions])
            for spec, task in zip(group.executions, self.data.dispatch_group(group)):
                watch_execution(task, spec.execution_id, self.data.executions_dir / spec.execution_id, self._error)
        logger.info("dispatched groups %d..%d at version %d (w=%d)", d.first_group, d.first_group + d.n_groups - 1,
                    d.version, self.sched.water_level)

    def _carry_over(self, g: int, row: dict[str, Any]) -> None:
        """An earlier attempt's group (a `groups.jsonl` row) as dispatch slot `g`, its v_d the version
        it was sampled at: its evaluated executions start and finish at once; those the execution
        plane still runs (`row["live"]`) are adopted, and end when the plane says so."""
        group, results = attempts.carried_group(self.run_dir, self.dataset, row)
        self.ledger.add_group(g, group, row["version"], carried=True)
        self.records.journal.dispatched(row["group_id"], row["task_id"], row["version"], row["executions"])
        for result in results:
            self._apply(self.sched.on_execution_started(g, result.index))
            self._apply(self.sched.on_execution_finished(g, result.index))
            self.ledger.evaluated(result)
        done = {r.execution_id for r in results}
        running = [spec for spec in group.executions if spec.execution_id not in done]
        for spec in running:
            self.adopted.add(spec.execution_id)  # its events are the adoption's, not _on_exec_event's
            self._apply(self.sched.on_execution_started(g, spec.index))
            self.data.adopt(spec.execution_id).add_done_callback(functools.partial(self._adopted_end, spec.execution_id))
        logger.info("group %s (dispatched at version %d in an earlier attempt) carried over as group %d%s",
                    group.group_id, row["version"], g, f", {len(running)} executions still running" if running else "")
        if not running:
            self._spawn(self._make_work(g))

    def _adopted_end(self, execution_id: str, fut: Any) -> None:
        """An adopted execution ended in the execution plane: finished, then evaluated."""
        result = None if fut.cancelled() or fut.exception() is not None else fut.result()
        if result is None:
            self.ending.fail(RunFailed(f"execution {execution_id} (adopted from an earlier attempt) ended without a "
                                       f"result in the execution plane"))
            return
        self._finished(execution_id, result.outcome.value)
        self._evaluated(result)

    def _switch_to_train(self, d: SwitchToTrain) -> None:
        self.ledger.switch_sent(d.cell, time.time())

        async def drain_then_send() -> None:
            moved = await self.data.drain(f"cell{d.cell}")  # in-flight calls continue elsewhere
            logger.info("cell %d drained (%d calls rerouted); switching to train", d.cell, moved)
            self._send_cell(d.cell, ToTrain())

        self._spawn(drain_then_send())

    def _switch_to_rollout(self, d: SwitchToRollout) -> None:
        self.pending.discard(d.cell)  # no more work for it this burst
        self.ledger.switch_sent(d.cell, time.time())
        self._send_cell(d.cell, ToRollout(version=self.sched.published))

    def _optimizer_step(self, d: OptimizerStep) -> None:
        """`Reduce` to exactly the decision's cells (the TRAIN prefix 0..k−1 the scheduler decided).
        |E| is known only now (groups were packed with B·N): the core rescales the summed gradient
        by B·N/valid, or skips the update when nothing is valid or trained (all-equal groups)."""
        if d.cells != tuple(range(len(d.cells))):
            raise RuntimeError(f"step {d.step}: reduce cells {d.cells} are not a prefix 0..k−1")
        valid, grad_scale = step_denominator([self.ledger.groups[g].rewards for g in d.groups],
                                             nominal=self.nominal, loss=self.loss_cfg)
        trained = any(self.ledger.groups[g].work.trains for g in d.groups)
        self.ledger.decide(d.step, d.cells, d.groups, d.final_in_burst, valid, grad_scale)
        for c in d.cells:
            self.pending.discard(c)
            self._send_cell(c, Reduce(step=d.step, k=len(d.cells), final=d.final_in_burst,
                                      stay=self.scheduler_cfg.mode == "async", grad_scale=grad_scale, trained=trained))

    def _publish(self, d: Publish) -> None:
        ranks = [r for c in range(self.topo.num_cells) if self.sched.roles[c] is CellRole.ROLLOUT
                 for r in self.topo.cell_ranks(c)]
        for r in ranks + [r for e in range(self.topo.num_pool_engines) for r in self.topo.pool_engine_ranks(e)]:
            self._command(r, Load(version=d.version))

    def _serve_pending(self) -> None:
        for cell in sorted(self.pending):
            w = self.sched.request_work(cell)
            if w is None:
                continue
            self.pending.discard(cell)
            bundle = self.ledger.groups[w.group].work.bundles[w.item]
            self.ledger.claim(w.step, cell)
            if self.train_cfg.audit_dir:
                audit_bundle(self.train_cfg.audit_dir, w.step, w.group, w.item, cell, bundle)
            for r in self.topo.cell_ranks(cell):
                key = f"ms/{w.step}/{w.group}/{w.item}/{r}"
                self.plane.put_blob(key, bundle)
                self._command(r, TrainWork(step=w.step, group=w.group, item=w.item, key=key, version=w.step))

    # ------------------------------------------------------------------ messages from cells
    def _on_message(self, msg: Report) -> None:
        """Handle one report; UnknownMessage for a type `HANDLERS` does not hold."""
        handler = handler_for(self.HANDLERS, msg, "controller")
        self.watch.heard(msg.rank, type(msg), time.monotonic())  # any report: the rank is alive
        handler(self, msg)

    def _on_transition(self, msg: Transition) -> None:
        self.ledger.transition(msg.cell, msg.dst, msg.t)

    def _on_joined(self, msg: Joined) -> None:
        self.ledger.handover(msg.handover_s)
        if self.sched.roles[msg.cell] is CellRole.TO_TRAIN:
            self.ledger.switched(msg.cell, "to_train", time.time())
        self._apply(self.sched.on_switch_done(msg.cell, "train"))  # superseded if the burst already ended

    def _on_request_work(self, msg: RequestWork) -> None:
        self.pending.add(msg.cell)

    def _on_work_done(self, msg: WorkDone) -> None:
        self.ledger.merge_metrics(msg.step, msg.metrics)
        self._apply(self.sched.on_work_done(msg.cell, Work(msg.step, msg.group, msg.item)))

    def _on_step_done(self, msg: StepDone) -> None:
        rec = self.ledger.close(msg.step)
        self.records.journal.trained([self.ledger.groups[g].group_id for g in rec.groups], msg.step)
        now = time.time()
        row = step_row(self.ledger, msg.step, now, step_time_s=now - self.last_step_t, scheduler=self.sched,
                       reroutes=self.data.reroutes(), rerouted=self.data.take_reroutes(),
                       unmatched_turns=self.data.take_unmatched(), sink_errors=self.data.sink_errors(), stats=msg.stats)
        self.records.step(row)
        if "checkpoint_s" in msg.stats:  # the core wrote a periodic checkpoint: does a stop still fit it?
            self.ending.checkpointed(float(msg.stats["checkpoint_s"]), self.budget.shutdown_s)
        self.last_step_t = now
        logger.info("%s", self.progress.step(row, self.sched, time.monotonic()))
        self._apply(self.sched.on_step_done(msg.step))
        if self.records.steps >= self.train_cfg.steps:
            self.ending.stopping = True

    def _on_rolled_back(self, msg: RolledBack) -> None:
        self.ledger.handover(msg.handover_s)
        self.ledger.switched(msg.cell, "to_rollout", time.time())
        self.data.resume(f"cell{msg.cell}")
        self._apply(self.sched.on_switch_done(msg.cell, "rollout"))

    def _on_loaded(self, msg: Loaded) -> None:
        pass  # nothing waits for it: an engine serves the old version until it has loaded the new

    def _on_stopped(self, msg: Stopped) -> None:
        self.ending.stopped[msg.rank] = msg

    def _on_failed(self, msg: Failed) -> None:  # a worker raised; it exits after this report
        self.ending.stopped[msg.rank] = msg
        self.watch.forget(msg.rank)
        self.ending.fail(RunFailed(f"rank {msg.rank} failed while handling {msg.command!r}: {msg.error} (its traceback "
                             f"is in rank {msg.rank}'s log)"))

    def _on_interrupted(self, msg: Interrupted) -> None:
        """SIGINT/SIGTERM on a rank (the first report counts): the stop, within `train.shutdown_timeout_s`."""
        at = stop.signalled_at(self.interrupts, time.monotonic())
        if self.ending.interrupt(msg.signal, msg.rank, at, self.budget.shutdown_s):
            self.ending.fail(RunFailed(f"interrupted by {msg.signal} (received by rank {msg.rank}); stopped "
                                       f"gracefully after {self.records.steps} steps"))

    # ------------------------------------------------------------------ executions
    def _on_exec_event(self, ev: ExecutionEvent) -> None:
        """The runner's events of this attempt's executions (an execution plane replays earlier
        attempts' too: those it does not know or adopted are not its business here)."""
        if ev.execution_id in self.adopted or not self.ledger.knows(ev.execution_id):
            return
        if ev.kind is EventKind.STARTED:
            rec, index = self.ledger.of_execution(ev.execution_id)
            self._apply(self.sched.on_execution_started(rec.index, index))
        elif ev.kind is EventKind.FINISHED:
            self._finished(ev.execution_id, ev.result.outcome.value)
        elif ev.kind is EventKind.EVALUATED:
            self._evaluated(ev.result)

    def _finished(self, execution_id: str, outcome: str) -> None:
        rec, index = self.ledger.of_execution(execution_id)
        self.ledger.finished(execution_id, outcome)
        self._apply(self.sched.on_execution_finished(rec.index, index))

    def _evaluated(self, result: Any) -> None:
        problem = self.health.observe(result, self.ledger.execution(result.execution_id).calls)
        if problem is not None:
            self.ending.fail(RunFailed(problem))
        if (rec := self.ledger.evaluated(result)).complete:
            self._spawn(self._make_work(rec.index))

    async def _make_work(self, g: int) -> None:
        """The group's scored executions (an incomplete TITO excluded: the ledger) → its bundles."""
        rec, tc = self.ledger.groups[g], self.train_cfg
        scored = self.ledger.scored(g, functools.partial(tito_records, self.tito))
        work = await asyncio.to_thread(group_work, rec.group_id, rec.version, scored, num_executions=self.nominal,
                                       max_tokens=tc.max_tokens, j_max=tc.j_max, normalize_std=tc.normalize_std,
                                       rng=np.random.default_rng([self.seed, g]))
        self.ledger.set_work(g, work)
        self._apply(self.sched.on_group_ready(g, len(work.bundles)))

    # One handler per scheduler decision and per report type (tests/runtime/test_messages.py).
    DECISIONS: dict[type, Callable[[Controller, Any], None]] = {
        Dispatch: _dispatch,
        SwitchToTrain: _switch_to_train,
        SwitchToRollout: _switch_to_rollout,
        OptimizerStep: _optimizer_step,
        Publish: _publish,
    }
    HANDLERS: dict[type[Report], Callable[[Controller, Any], None]] = {
        Transition: _on_transition,
        Joined: _on_joined,
        RequestWork: _on_request_work,
        WorkDone: _on_work_done,
        StepDone: _on_step_done,
        RolledBack: _on_rolled_back,
        Loaded: _on_loaded,
        Stopped: _on_stopped,
        Failed: _on_failed,
        Interrupted: _on_interrupted,
    }
