"""TensorBoard event files with the tensorboard package alone (no TensorFlow or PyTorch), and W&B if tracked."""

import glob
import os
import time

from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class SummaryWriter:
    """TensorBoard event files via the tensorboard package alone (no TF/torch), and W&B if tracked."""

    def __init__(self, logdir: str, use_wandb: bool, resume_step: int):
        """A run that starts again (resumed, or restarted after a crash) keeps what its earlier event files
        logged up to resume_step and drops the rest, so its curves continue without duplicated steps (a step
        logged out of order would make TensorBoard discard everything after it)."""
        earlier_files = sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*")))
        self.event_writer = EventFileWriter(logdir)
        for path in earlier_files:
            for record in RawEventFileLoader(path).Load():  # raw: EventFileLoader would convert the values
                event = event_pb2.Event.FromString(record)
                if event.HasField("summary") and resume_step > 0 and event.step <= resume_step:
                    self.event_writer.add_event(event)
        self.event_writer.flush()
        for path in earlier_files:
            os.remove(path)
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
