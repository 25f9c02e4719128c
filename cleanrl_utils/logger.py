"""Logging of a run: TensorBoard (process 0), W&B with --track, the console line, throughput and memory.

Per update the learner passes its own scalars (losses, learning rate, policy versions, learner times) and the
actor threads' stats; the logger adds SPS, episode returns and lengths, the actors' mean stage times and the
peak memory, writes them at the update's global step, and prints a console line every `--log-frequency` updates.
An actor thread's stats are what its `StageTimer` and `EpisodeStats` read out (the names below are the ones logged);
an Anakin run passes its envs' episode statistics alone.
"""

import re
import resource
import sys
import time
from collections.abc import Sequence

import numpy as np

from cleanrl_utils.summary_writer import SummaryWriter

# an actor thread's stages, logged as stats/{stage}: seconds per update, the mean over the actor threads
ACTOR_STAGES = (
    "params_queue_get_time",
    "rollout_time",
    "inference_time",
    "env_step_time",
    "storage_time",
    "rollout_queue_put_time",
)


class _Stage:
    __slots__ = ("seconds", "name", "start")

    def __init__(self, seconds: dict, name: str):
        self.seconds, self.name = seconds, name

    def __enter__(self):
        self.start = time.time()

    def __exit__(self, *exception):
        self.seconds[self.name] += time.time() - self.start


class StageTimer:
    """`with timer("inference_time"): ...` adds the block's seconds to its stage (one of ACTOR_STAGES; nested stages
    count in both); `read()` returns the seconds since the last read and starts again from 0."""

    def __init__(self):
        self.seconds = dict.fromkeys(ACTOR_STAGES, 0.0)
        self.stages = {name: _Stage(self.seconds, name) for name in ACTOR_STAGES}

    def __call__(self, stage: str) -> _Stage:
        return self.stages[stage]  # a KeyError names a stage the logger would not know

    def read(self) -> dict:
        seconds = dict(self.seconds)
        self.seconds.update(dict.fromkeys(ACTOR_STAGES, 0.0))
        return seconds


class EpisodeStats:
    """Each env's last finished episode on the real game: unclipped rewards (Atari's info["reward"]) summed over whole
    games despite episodic life (info["terminated"] marks game over, not a lost life); envpool's reset step after an
    episode's end is not a step of the game. NaN until an env finishes its first episode. `begun_before` marks the envs
    whose first episode began before the first rollout (cleanrl_utils/envs.py's warm-up): the agent played only its
    end, so it is not counted; their statistics start with their second episode."""

    def __init__(self, num_envs: int, begun_before: np.ndarray | None = None):
        self.episode_returns = np.zeros(num_envs, dtype=np.float64)
        self.episode_lengths = np.zeros(num_envs, dtype=np.int64)
        self.returned_episode_returns = np.full(num_envs, np.nan)
        self.returned_episode_lengths = np.full(num_envs, np.nan)
        self.uncounted = np.zeros(num_envs, dtype=bool) if begun_before is None else np.array(begun_before, bool)

    def step(self, reward, terminated, truncated, info: dict, counted):
        """After an env step; `counted`: the envs whose step was a step of the game (not envpool's reset step)."""
        self.episode_returns += info.get("reward", reward)
        self.episode_lengths += counted
        game_over = np.logical_or(info["terminated"] if "terminated" in info else terminated, truncated)
        counted_end = game_over & ~self.uncounted
        self.uncounted &= ~game_over
        self.returned_episode_returns = np.where(counted_end, self.episode_returns, self.returned_episode_returns)
        self.returned_episode_lengths = np.where(counted_end, self.episode_lengths, self.returned_episode_lengths)
        self.episode_returns *= ~game_over
        self.episode_lengths *= ~game_over

    def read(self) -> dict:
        return {
            "returned_episode_returns": self.returned_episode_returns.copy(),
            "returned_episode_lengths": self.returned_episode_lengths.copy(),
        }


def episode_scalars(returns: np.ndarray, lengths: np.ndarray) -> dict:
    """charts/avg_episodic_return and _length: the mean over envs of their last finished episodes (NaN: none yet);
    nothing before any env has finished one."""
    if np.all(np.isnan(returns)):
        return {}
    return {"charts/avg_episodic_return": np.nanmean(returns), "charts/avg_episodic_length": np.nanmean(lengths)}


def seeds_episode_scalars(per_seed: list[dict]) -> dict:
    """The run folder's episode scalars of several seeds (`episode_scalars` of each): the mean of the seeds' values,
    each seed weighing the same however many of its envs have finished an episode, and the min and max return over
    the seeds; the seeds that have finished no episode yet are left out (nothing before any has)."""
    finished = [seed for seed in per_seed if seed]
    if not finished:
        return {}
    seed_returns = [seed["charts/avg_episodic_return"] for seed in finished]
    return {
        "charts/avg_episodic_return": np.mean(seed_returns),
        "charts/avg_episodic_length": np.mean([seed["charts/avg_episodic_length"] for seed in finished]),
        "charts/avg_episodic_return_min": np.min(seed_returns),
        "charts/avg_episodic_return_max": np.max(seed_returns),
    }


def peak_rss_mib() -> float:
    """The process's peak resident memory so far (ru_maxrss is in KiB on Linux, bytes on macOS)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (2**20 if sys.platform == "darwin" else 2**10)


def device_peak_memory_mib() -> dict:
    """Peak memory of this process's accelerators so far (GPU/TPU: JAX's allocator statistics; CPU has none). With
    JAX's default preallocation a GPU looks 75% full to nvidia-smi; this is what the run actually used."""
    import jax

    stats = [device.memory_stats() for device in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if s and "peak_bytes_in_use" in s]
    return {"stats/device_peak_memory_mib": max(peaks) / 2**20} if peaks else {}


class RunLogger:
    def __init__(
        self,
        run_name: str,
        *,
        config: dict,
        batch_size: int,
        local_batch_size: int,
        num_updates: int,
        log_frequency: int,
        wandb_project: str | None,
        wandb_entity: str | None,
        is_main_process: bool,
        world_size: int,
        start_update: int,
        seeds: Sequence[int] | None = None,
    ):
        """Logs into runs/{run_name} (process 0), and into W&B's `wandb_project` if given (--track); `config`: the
        run's flags and derived values, its hyperparameters table. `batch_size` env steps per update over all
        processes (`local_batch_size` in this one), `num_updates` in all. `seeds`: the seeds of an Anakin run of
        several (--num-seeds), whose scalars come with a leading seed axis: each seed is logged into
        runs/{run_name}/seed{seed} (TensorBoard shows them as runs, in the same charts), and runs/{run_name} (the
        console, W&B) gets the mean of the seeds' values, and the min and max over seeds of the episodic return
        (`seeds_episode_scalars`)."""
        self.batch_size, self.local_batch_size, self.num_updates = batch_size, local_batch_size, num_updates
        self.log_frequency, self.world_size, self.start_update = log_frequency, world_size, start_update
        self.track = wandb_project is not None
        self.seeds = seeds if seeds and len(seeds) > 1 else None
        self.start_time = time.time()
        self.writer, self.seed_writers = None, []
        if is_main_process:
            if self.track:
                import wandb

                wandb.init(
                    project=wandb_project,
                    entity=wandb_entity,
                    config=config,
                    name=run_name,
                    id=re.sub(r"[^\w.-]", "_", run_name),
                    resume="allow",
                    save_code=True,
                )
            resume_step = start_update * batch_size
            self.writer = SummaryWriter(f"runs/{run_name}", use_wandb=self.track, resume_step=resume_step)
            self.seed_writers = [
                SummaryWriter(f"runs/{run_name}/seed{seed}", use_wandb=False, resume_step=resume_step)
                for seed in self.seeds or []
            ]
            if start_update == 0:  # a resumed run keeps its first hyperparameters table (step 0)
                self.writer.add_text(
                    "hyperparameters",
                    "|param|value|\n|-|-|\n" + "\n".join(f"|{key}|{value}|" for key, value in config.items()),
                )

    def log_update(self, update: int, scalars: dict, actor_stats: list[dict]):
        """`scalars` holds stats/actor_policy_version and stats/learner_policy_version (the console shows them)."""
        global_step = update * self.batch_size
        elapsed = time.time() - self.start_time
        # the envs' last finished episodes: one row per seed (one row without seeds), the envs along the last axis
        returns = np.concatenate([np.atleast_2d(s["returned_episode_returns"]) for s in actor_stats], axis=-1)
        lengths = np.concatenate([np.atleast_2d(s["returned_episode_lengths"]) for s in actor_stats], axis=-1)
        scalars = {
            "charts/SPS": int((update - self.start_update) * self.batch_size / elapsed),
            **scalars,
            # a Sebulba run's actor threads time their stages; an Anakin run's one program has none
            **{
                f"stats/{name}": np.mean([s[name] for s in actor_stats])
                for name in ACTOR_STAGES
                if name in actor_stats[0]
            },
            "stats/peak_rss_mib": peak_rss_mib(),
            **device_peak_memory_mib(),
        }
        if self.seeds is None:
            episodes = episode_scalars(returns, lengths)
        else:
            per_seed = [episode_scalars(returns[i], lengths[i]) for i in range(len(returns))]
            for i, writer in enumerate(self.seed_writers):
                seed_scalars = {tag: np.asarray(value)[i] for tag, value in scalars.items() if np.ndim(value) == 1}
                writer.add_scalars({**seed_scalars, **per_seed[i]}, global_step)
            episodes = seeds_episode_scalars(per_seed)
        # an Anakin run's scalars have a seed axis (of one seed without --num-seeds): their mean over the seeds
        scalars = {tag: np.mean(value) if np.ndim(value) else value for tag, value in scalars.items()}
        scalars.update(episodes)
        if self.writer is not None:
            self.writer.add_scalars(scalars, global_step)
            self.flush()  # on disk before any checkpoint of this update counts as complete
        if update % self.log_frequency == 0 or update == self.num_updates:
            eta = (self.num_updates - update) * elapsed / (update - self.start_update)
            process_sps = int(self.local_batch_size * (update - self.start_update) / elapsed)
            process_sps = f"process_SPS={process_sps} " if self.world_size > 1 else ""
            seeds = (
                f"(seeds: min {scalars['charts/avg_episodic_return_min']:.2f} "
                f"max {scalars['charts/avg_episodic_return_max']:.2f}) "
                if "charts/avg_episodic_return_min" in scalars
                else ""
            )
            print(
                f"update={update}/{self.num_updates} global_step={global_step} SPS={scalars['charts/SPS']} "
                f"{process_sps}avg_episodic_return={scalars.get('charts/avg_episodic_return', float('nan')):.2f} "
                f"{seeds}actor_policy_version={scalars['stats/actor_policy_version']:.0f} "
                f"learner_policy_version={scalars['stats/learner_policy_version']:.0f} ETA={eta:.0f}s",
                flush=True,
            )

    def flush(self):
        """On disk now: an update's scalars are written before its checkpoint counts as complete."""
        for writer in [self.writer, *self.seed_writers] if self.writer is not None else []:
            writer.flush()

    def close(self):
        if self.writer is not None:
            for writer in [self.writer, *self.seed_writers]:
                writer.close()
            self.writer, self.seed_writers = None, []

    def finish(self):
        self.close()
        if self.track and self.writer is None and "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                wandb.finish()
