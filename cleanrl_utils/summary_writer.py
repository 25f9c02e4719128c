"""TensorBoard event files with the tensorboard package alone (no TensorFlow or PyTorch), and W&B if tracked."""

import glob
import json
import os
import time

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.summary.writer.record_writer import RecordWriter

from cleanrl_utils.run_folder import atomic_write

# names without "tfevents": TensorBoard reads every file whose name holds it
REWRITTEN = ".events-rewrite.tmp"
JOURNAL = ".events-rewrite.json"


def finish_rewrite(logdir: str):
    """Complete a rewrite that a crash interrupted after its journal was written (roll forward): the rewritten
    file takes its final name, the files it replaces go. Before the journal, the half-written file is dropped."""
    journal, rewritten = os.path.join(logdir, JOURNAL), os.path.join(logdir, REWRITTEN)
    if os.path.exists(journal):
        with open(journal) as file:
            plan = json.load(file)
        if os.path.exists(rewritten):
            os.replace(rewritten, os.path.join(logdir, plan["final"]))
        for name in plan["remove"]:
            if os.path.exists(os.path.join(logdir, name)):
                os.remove(os.path.join(logdir, name))
        os.remove(journal)
    elif os.path.exists(rewritten):
        os.remove(rewritten)


def rewrite_events(logdir: str, keep_up_to_step: int):
    """The run's event files become one file that holds their scalars up to `keep_up_to_step`, crash-safe: the
    new file is written under a temporary name, then a journal (written atomically) says which name it takes and
    which files go; a kill anywhere leaves either the old files or, after `finish_rewrite`, the new one alone."""
    finish_rewrite(logdir)
    earlier_files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
    if not earlier_files:
        return
    with open(os.path.join(logdir, REWRITTEN), "wb") as file:
        records = RecordWriter(file)
        records.write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString())
        for path in earlier_files:
            for record in RawEventFileLoader(path).Load():  # raw: EventFileLoader would convert the values
                event = event_pb2.Event.FromString(record)
                if event.HasField("summary") and keep_up_to_step > 0 and event.step <= keep_up_to_step:
                    records.write(record)
        file.flush()
        os.fsync(file.fileno())
    # the oldest name, so the rewritten file sorts before the new run's file (TensorBoard reads them in order)
    atomic_write(os.path.join(logdir, JOURNAL), json.dumps({
        "final": os.path.basename(earlier_files[0]),
        "remove": [os.path.basename(path) for path in earlier_files[1:]]}).encode())
    finish_rewrite(logdir)


class SummaryWriter:
    """TensorBoard event files via the tensorboard package alone (no TF/torch), and W&B if tracked."""

    def __init__(self, logdir: str, use_wandb: bool, resume_step: int):
        """A run that starts again (resumed, or restarted after a crash) keeps what its earlier event files
        logged up to resume_step and drops the rest, so its curves continue without duplicated steps (a step
        logged out of order would make TensorBoard discard everything after it)."""
        os.makedirs(logdir, exist_ok=True)
        rewrite_events(logdir, resume_step)
        self.event_writer = EventFileWriter(logdir)
        self.use_wandb = use_wandb

    def add_scalars(self, scalars: dict, step: int):
        values = [summary_pb2.Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self.event_writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=values)))
        if self.use_wandb:
            import wandb

            wandb.log(scalars, step=step)

    def add_text(self, tag: str, text: str):
        tensor = tensor_pb2.TensorProto(dtype="DT_STRING", string_val=[text.encode()],
                                        tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[]))
        metadata = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
        value = summary_pb2.Summary.Value(tag=tag, tensor=tensor, metadata=metadata)
        self.event_writer.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary_pb2.Summary(value=[value])))

    def close(self):
        self.event_writer.close()
