"""Logging of a run: TensorBoard (process 0), W&B with --track, the console line, throughput and memory.

Per update the script passes its own scalars (losses, learning rate, policy versions, learner times) and the
actor threads' stats; the logger adds SPS, episode returns and lengths, the actors' mean stage times and the
peak memory, writes them at the update's global step, and prints a console line every `--log-frequency` updates.
"""

import re
import resource
import sys
import time
from dataclasses import asdict

import numpy as np

from cleanrl_utils.summary_writer import SummaryWriter

ACTOR_TIMES = ["params_queue_get_time", "rollout_time", "inference_time", "env_step_time", "storage_time",
               "rollout_queue_put_time"]


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
    def __init__(self, args, *, is_main_process: bool, world_size: int, start_update: int):
        self.args, self.world_size, self.start_update = args, world_size, start_update
        self.start_time = time.time()
        self.writer = None
        if is_main_process:
            if args.track:
                import wandb

                wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                           name=args.run_name, id=re.sub(r"[^\w.-]", "_", args.run_name), resume="allow",
                           save_code=True)
            self.writer = SummaryWriter(f"runs/{args.run_name}", use_wandb=args.track,
                                        resume_step=start_update * args.batch_size)
            if start_update == 0:  # a resumed run keeps its first hyperparameters table (step 0)
                self.writer.add_text("hyperparameters", "|param|value|\n|-|-|\n"
                                     + "\n".join(f"|{key}|{value}|" for key, value in asdict(args).items()))

    def log_update(self, update: int, scalars: dict, actor_stats: list[dict]):
        """`scalars` holds stats/actor_policy_version and stats/learner_policy_version (the console shows them)."""
        args = self.args
        global_step = update * args.batch_size
        elapsed = time.time() - self.start_time
        returns = np.concatenate([s["returned_episode_returns"] for s in actor_stats])
        lengths = np.concatenate([s["returned_episode_lengths"] for s in actor_stats])
        scalars = {"charts/SPS": int((update - self.start_update) * args.batch_size / elapsed), **scalars,
                   **{f"stats/{name}": np.mean([s[name] for s in actor_stats]) for name in ACTOR_TIMES},
                   "stats/peak_rss_mib": peak_rss_mib(), **device_peak_memory_mib()}
        if not np.all(np.isnan(returns)):
            scalars["charts/avg_episodic_return"] = np.nanmean(returns)
            scalars["charts/avg_episodic_length"] = np.nanmean(lengths)
        if self.writer is not None:
            self.writer.add_scalars(scalars, global_step)
            self.flush()  # on disk before any checkpoint of this update counts as complete
        if update % args.log_frequency == 0 or update == args.num_updates:
            eta = (args.num_updates - update) * elapsed / (update - self.start_update)
            process_sps = int(args.local_batch_size * (update - self.start_update) / elapsed)
            process_sps = f"process_SPS={process_sps} " if self.world_size > 1 else ""
            print(f"update={update}/{args.num_updates} global_step={global_step} SPS={scalars['charts/SPS']} "
                  f"{process_sps}avg_episodic_return={scalars.get('charts/avg_episodic_return', float('nan')):.2f} "
                  f"actor_policy_version={scalars['stats/actor_policy_version']:.0f} "
                  f"learner_policy_version={scalars['stats/learner_policy_version']:.0f} ETA={eta:.0f}s", flush=True)

    def flush(self):
        """On disk now: an update's scalars are written before its checkpoint counts as complete."""
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def finish(self):
        self.close()
        if self.args.track and self.writer is None and "wandb" in sys.modules:
            import wandb

            if wandb.run is not None:
                wandb.finish()
