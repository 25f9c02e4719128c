"""One run of a script: everything about it that is not the algorithm, behind one object (`SebulbaRun`, `AnakinRun`).

A Sebulba script's `main` is the Sebulba protocol; each line of bookkeeping is one call of its `SebulbaRun`:

    run = SebulbaRun(args, __file__, runtime_values)        # devices, derived values, run folder, checkpoints, signals
    args = run.args                                         # a copy of the flags, with the values derived from them
    state, actor_threads = run.start(state, state_summary)  # the newest checkpoint of --run-name or `state`; logger
    run.start_actor(actor, thread, ...)                     # for thread in actor_threads: a supervised daemon thread
    run.broadcast(params_queues, params, version)           # one copy of the params per actor device, to every thread
    with run.supervise():                                   # an actor's failure is raised here, with its traceback
        for update in run.updates():                        # until --total-timesteps, or a signal (SIGTERM, Ctrl-C)
            outputs = run.get_rollouts(rollout_queues)      # every thread's rollout of this update
            before = run.copy_learner_state(state)          # the update donates its input: kept in case it diverges
            state, metrics = learner_update(state, ...)     # the script's update, dispatched
            metrics = run.wait_for_finite(update, state, metrics, before)  # NaN or inf: checkpoints `before`, stops
            run.broadcast(params_queues, params, version=update)
            run.end_update(update, state, metrics, outputs)  # log; checkpoint every --checkpoint-frequency
    return run.finish(state, saved_model)                   # final checkpoint and digests, --save-model, exit code

`run.start` returns the actor threads because they depend on the update the run resumes from (their env seeds and
keys): the threads cannot exist before the checkpoint is read. An Anakin script's `AnakinRun` has the same calls but
the actor threads' (`start` returns the state alone; no `start_actor`, `broadcast`, `get_rollouts`): its envs are in
the learner state, and one compiled program per update acts, steps them and learns.

The learner state is a NamedTuple with the fields `agent` (params and optimizer state), `key` and, in a replay
script, `replay` (in an Anakin script, `envs`): it is what a checkpoint holds. With several processes every process
calls these methods in the same order (checkpoints and digests are collective).
"""

import copy
import dataclasses
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import NamedTuple

from cleanrl_utils import liveness
from cleanrl_utils.actors import ActorThread, ActorThreads, RunStopped, queue_get, queue_put
from cleanrl_utils.checkpoints import Checkpoints
from cleanrl_utils.data_path import anakin_layout_lines, layout_lines
from cleanrl_utils.devices import copies_for_devices, device_layout, envpool_num_threads
from cleanrl_utils.divergence import Diverged, all_finite, copy_state
from cleanrl_utils.flags import computation_flags, derive_batch_values, settable_flags
from cleanrl_utils.logger import RunLogger
from cleanrl_utils.preemption import Preemption
from cleanrl_utils.processes import distributed_started, shutdown
from cleanrl_utils.run_folder import RunFolder, default_run_name
from cleanrl_utils.saved_model import save_evaluate_upload


class ActorOutputs(NamedTuple):
    """What the learner got from its actor threads for one update."""

    storages: list  # per actor thread: its rollout, one part per local learner device
    actor_policy_version: int  # the params version every thread acted with
    actor_stats: list  # per actor thread: its stage times and episode statistics


class Run:
    """What a Sebulba and an Anakin run share: devices, run folder, checkpoints, logger, signals, the learner loop's
    bookkeeping and the end of a run. `SebulbaRun` adds the actor threads; `AnakinRun` has none."""

    def __init__(self, args, script: str, runtime_values: Callable | None = None):
        """Starts the run: JAX's devices (and jax.distributed), the values derived from the flags (the batch, then
        `runtime_values(args, layout)`, the script's own: it checks them, and sets those it derives), the run folder
        and its lock, the checkpoint folder, and the SIGTERM / Ctrl-C handlers. `self.args` holds the flags with those
        values and the default names filled in: a copy, the parsed flags are left as they are."""
        args = copy.copy(args)
        if args.exp_name is None:
            args.exp_name = os.path.basename(script)[: -len(".py")]
        self.args, self.script = args, script
        self.layout = layout = device_layout(args)  # jax.distributed, host devices, the mesh over every process
        self.mesh, self.actor_devices = layout.mesh, layout.actor_devices
        derive_batch_values(
            args, world_size=layout.world_size, local_rank=layout.local_rank, **self.env_copies(args, layout)
        )
        if runtime_values is not None:
            runtime_values(args, layout)
        if args.run_name is None:
            args.run_name = default_run_name(args.env_id, args.exp_name, args.seed)
        self.folder = RunFolder(args.run_name, args.checkpoint_dir, is_main_process=layout.is_main_process)
        self.checkpoints = Checkpoints(
            args.checkpoint_dir or f"runs/{args.run_name}/checkpoints",
            keep=args.checkpoint_keep,
            world_size=layout.world_size,
        )
        self.stop_event = threading.Event()  # set by whoever stops the run; every queue wait sees it
        self.preemption = Preemption(layout.world_size, self.stop_event)  # stop after an update, checkpoint
        self.start_update = self.update = 0  # the update the run starts after, and the last one done
        self.summary, self.logger = None, None
        self.update_started, self.training_time = 0.0, 0.0

    @staticmethod
    def env_copies(args, layout) -> dict:
        """How many groups of --local-num-envs this process steps, and the flags that set it (for messages)."""
        raise NotImplementedError

    # ------------------------------------------------------------ the learner's state

    def start(self, state, summary: Callable[[object], str]):
        """The newest complete checkpoint of the run, in the shapes (and on the devices) of `state`, or `state`
        itself when there is none; then the logger (TensorBoard, W&B) from that update on. `summary(state)`: the
        state's digests, printed with every checkpoint."""
        args = self.args
        self.summary = summary
        state, self.start_update = self.checkpoints.restore(
            state, batch_size=args.batch_size, flags=computation_flags(args), resume=args.resume, summary=summary
        )
        self.update = self.start_update
        self.logger = RunLogger(
            args.run_name,
            config=dataclasses.asdict(args),
            batch_size=args.batch_size,
            local_batch_size=args.local_batch_size,
            num_updates=args.num_updates,
            log_frequency=args.log_frequency,
            wandb_project=args.wandb_project_name if args.track else None,
            wandb_entity=args.wandb_entity,
            is_main_process=self.layout.is_main_process,
            world_size=self.layout.world_size,
            start_update=self.start_update,
            seeds=self.seeds,
        )
        return state

    @property
    def seeds(self) -> range:
        """The seeds of the run: --seed, and with an Anakin script's --num-seeds N the N - 1 after it (a range, not a
        list: a --num-seeds no host can hold reaches the memory check of their states, cleanrl_utils/devices.py's
        `stack_seeds`, instead of a list of billions of ints)."""
        return range(self.args.seed, self.args.seed + getattr(self.args, "num_seeds", 1))

    def save(self, update: int, state):
        self.checkpoints.save(
            update,
            state,
            global_step=update * self.args.batch_size,
            flags=settable_flags(self.args),
            summary=self.summary(state),
        )

    # ------------------------------------------------------------ the learner loop

    @contextmanager
    def supervise(self):
        """Around the learner loop: the logger is closed on the way out (a signal ends the loop through `updates`, and
        the final checkpoint follows)."""
        try:
            yield
        finally:
            self.logger.close()

    def updates(self):
        """The updates after the one the run starts at, to --total-timesteps; a signal (SIGTERM, Ctrl-C) ends them after
        an update that every process agrees on."""
        for update in range(self.start_update + 1, self.args.num_updates + 1):
            if self.preemption.requested():
                return
            yield update

    def copy_learner_state(self, state):
        """A copy of the state an update starts from (the update donates its input buffers), for `wait_for_finite`:
        all but the replay (env data, always finite, and large)."""
        self.update_started = time.time()
        return copy_state(state._replace(replay=None) if hasattr(state, "replay") else state)

    def wait_for_finite(self, update: int, state, metrics: dict, before) -> dict:
        """Waits for the update and returns its metrics as host values. A NaN or an infinity in them or in the new
        `state.agent` stops the run: `before` (with the replay as it is now) is checkpointed as update - 1 and
        `Diverged` raised, never a wrong model trained on or saved."""
        import jax

        metrics = jax.device_get(metrics)  # waits for the update
        self.training_time = time.time() - self.update_started
        if not all_finite(metrics, state.agent):
            if hasattr(state, "replay"):  # the replay as it is now (it holds this update's rollout too)
                before = before._replace(replay=state.replay)
            self.save(update - 1, before)
            raise Diverged(update, metrics)
        return metrics

    def log_and_checkpoint(self, update: int, state, scalars: dict, actor_stats: list[dict], actor_policy_version):
        """The update's scalars to TensorBoard (and the console), then its checkpoint, every --checkpoint-frequency."""
        scalars = {
            **scalars,
            "stats/actor_policy_version": actor_policy_version,
            "stats/learner_policy_version": update - 1,  # the version the gradient was taken at
            "stats/training_time": self.training_time,
        }
        if "stats/gradient_steps" in scalars:  # a replay learner's gradient steps of this update
            scalars["stats/gradient_steps_per_second"] = scalars["stats/gradient_steps"] / self.training_time
        self.logger.log_update(update, scalars, actor_stats)
        self.update = update
        if self.args.checkpoint_frequency and update % self.args.checkpoint_frequency == 0:
            self.save(update, state)

    # ------------------------------------------------------------ the end

    def finish(self, state, saved_model: Callable[[object], dict]) -> int:
        """The end of a run, stopped or complete: the final checkpoint, every process's digests, with --save-model
        (process 0, a complete run only) `saved_model(state)` saved, evaluated and uploaded; the exit code."""
        args, layout = self.args, self.layout
        self.preemption.requested()  # once more: a signal that reached any process in the last update counts too
        self.save(self.update, state)
        self.checkpoints.close()
        # every process prints this: equal digests show that all learner replicas hold the same state
        print(f"process {layout.local_rank}: final {self.summary(state)}", flush=True)
        self.preemption.report(self.update, args.run_name)
        upload_succeeded = True
        if args.save_model and layout.is_main_process and not self.preemption.stop_signal:
            models = saved_model(state)  # a dict; an Anakin script's, a list of one per seed
            if isinstance(models, dict) or len(self.seeds) == 1:
                upload_succeeded = save_evaluate_upload(
                    args, self.script, models if isinstance(models, dict) else models[0]
                )
            else:  # one model per seed, each saved and evaluated as the run of its --seed alone would be
                for seed, model in zip(self.seeds, models):
                    seed_args = copy.copy(args)
                    seed_args.seed, seed_args.num_seeds, seed_args.run_name = seed, 1, f"{args.run_name}/seed{seed}"
                    upload_succeeded &= save_evaluate_upload(seed_args, self.script, model)
        self.logger.finish()
        self.folder.release()
        liveness.stop_watching()  # peers leave the barrier below one by one: none of them is a silent host
        shutdown()  # jax.distributed
        liveness.close()
        # 143 SIGTERM, 130 Ctrl-C; 1: the model, card and video are on disk (see the error above), the upload is missing
        return self.preemption.exit_code or (0 if upload_succeeded else 1)


class SebulbaRun(Run):
    """A Sebulba run: the actor threads (supervised, fed through size-1 queues) on top of `Run`."""

    def __init__(self, args, script: str, runtime_values: Callable | None = None):
        super().__init__(args, script, runtime_values)
        self.actors = ActorThreads(self.stop_event)
        self.actor_threads: list[ActorThread] = []
        self.rollout_queue_get_time = 0.0

    @staticmethod
    def env_copies(args, layout) -> dict:
        return {
            "env_copies": args.num_actor_threads * len(layout.actor_devices),
            "copies_flags": "--num-actor-threads x actor devices",
        }

    def start(self, state, summary: Callable[[object], str]) -> tuple[object, list[ActorThread]]:
        """`Run.start`, then this process's actor threads, `--num-actor-threads` per actor device: where each runs,
        and its env seeds and keys, which depend on the update the run starts from."""
        state = super().start(state, summary)
        args, layout = self.args, self.layout
        num_threads = len(layout.actor_devices) * args.num_actor_threads
        envpool_threads = envpool_num_threads(args.envpool_threads, num_threads)
        self.actor_threads = [
            ActorThread(
                index=index,
                global_index=layout.local_rank * num_threads + index,
                device=layout.actor_devices[index // args.num_actor_threads],
                learner_devices=layout.learner_devices,
                start_update=self.start_update,
                envpool_threads=envpool_threads,
                stop_event=self.stop_event,
                queue_timeout=args.queue_timeout,
            )
            for index in range(num_threads)
        ]
        lines = layout_lines(
            mesh=self.mesh,
            learner_devices=layout.learner_devices,
            thread_devices=[thread.device for thread in self.actor_threads],
            local_num_envs=args.local_num_envs,
        )
        print("\n".join(lines), flush=True)  # the layout, as data_path.py's formula places each env
        return state, self.actor_threads

    def start_actor(self, target: Callable, thread: ActorThread, **kwargs):
        """`target(thread=thread, **kwargs)` in a daemon thread; its failure stops the run (raised by `supervise`)."""
        self.actors.start(target, name=f"actor-{thread.index}", thread=thread, **kwargs)

    def broadcast(self, params_queues: list, params, version: int):
        """`(params, version)` to every actor thread: one copy per actor device, shared by its threads."""
        params_per_device = copies_for_devices(params, self.actor_devices)
        for params_queue, thread in zip(params_queues, self.actor_threads):
            queue_put(
                params_queue, (params_per_device[thread.device], version), self.stop_event, self.args.queue_timeout
            )

    # ------------------------------------------------------------ the learner loop

    @contextmanager
    def supervise(self):
        """Around the learner loop: a stop by signal ends the loop quietly (the final checkpoint follows), an actor's
        failure is raised here with its traceback, and every actor thread is stopped on the way out. With
        jax.distributed, a failure leaves the threads to the CLI entry, which ends the process at once (a peer may
        wait in a collective; joining threads would only delay its own stop)."""
        failed = False
        try:
            try:
                yield
            except RunStopped:
                self.actors.check()  # an actor failed: raise its error; otherwise a signal stopped the run
                if not self.preemption.received:
                    raise
        except BaseException:
            failed = True
            raise
        finally:
            if failed and distributed_started():
                self.stop_event.set()
                self.logger.close()
            else:
                stuck = self.actors.stop()
                self.logger.close()
                if stuck:
                    print(
                        f"warning: actor threads {stuck} did not stop within {self.actors.join_timeout:.0f}s",
                        file=sys.stderr,
                        flush=True,
                    )

    def get_rollouts(self, rollout_queues: list) -> ActorOutputs:
        """Every actor thread's `(rollout, actor_policy_version, stats)` of this update."""
        start = time.time()
        storages, versions, stats = zip(
            *(queue_get(q, self.stop_event, self.args.queue_timeout) for q in rollout_queues)
        )
        assert len(set(versions)) == 1, f"actor threads out of step: versions {versions}"
        self.rollout_queue_get_time = time.time() - start
        return ActorOutputs(list(storages), versions[0], list(stats))

    def end_update(self, update: int, state, metrics: dict, outputs: ActorOutputs):
        """The update's scalars (with the actor threads' stats) logged, then its checkpoint, every
        --checkpoint-frequency."""
        metrics = {**metrics, "stats/rollout_queue_get_time": self.rollout_queue_get_time}
        self.log_and_checkpoint(update, state, metrics, outputs.actor_stats, outputs.actor_policy_version)


class AnakinRun(Run):
    """An Anakin run: no actor threads; the envs are part of the learner state, stepped by the compiled update on
    every learner device, --local-num-envs each."""

    @staticmethod
    def env_copies(args, layout) -> dict:
        return {"env_copies": len(layout.learner_devices), "copies_flags": "learner devices (--learner-device-ids)"}

    def start(self, state, summary: Callable[[object], str]):
        """`Run.start`, then the layout printed: the learner mesh in order, each of this process's learner devices
        and the global indices of the envs it steps (cleanrl_utils/data_path.py)."""
        state = super().start(state, summary)
        lines = anakin_layout_lines(mesh=self.mesh, local_num_envs=self.args.local_num_envs)
        print("\n".join(lines), flush=True)
        return state

    def end_update(self, update: int, state, metrics: dict, episode_stats: dict):
        """The update's scalars and this process's envs' `episode_stats` (as `EpisodeStats.read()` gives them)
        logged, then its checkpoint, every --checkpoint-frequency. The actor is the learner's current policy."""
        self.log_and_checkpoint(update, state, metrics, [episode_stats], actor_policy_version=update - 1)
