"""TensorBoard's side of tests/tensorboard.rs: a run folder read back with
TensorBoard's own reader.

    read_tensorboard.py RUN_DIR
        EventAccumulator(RUN_DIR) with nothing sampled away, reloaded; on
        stdout one JSON object:
        {"scalars": {tag: [[step, value, wall_time], ...]},
         "texts": {tag: [[step, text], ...]},
         "files": [file names TensorBoard counts as event files]}
"""

import json
import math
import os
import sys

from tensorboard.backend.event_processing import event_accumulator, io_wrapper
from tensorboard.util import tensor_util


def main(run_dir):
    acc = event_accumulator.EventAccumulator(
        run_dir,
        size_guidance={
            event_accumulator.SCALARS: 0,
            event_accumulator.TENSORS: 0,
        },
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {}
    for tag in tags[event_accumulator.SCALARS]:
        scalars[tag] = [
            [e.step, e.value if math.isfinite(e.value) else str(e.value), e.wall_time]
            for e in acc.Scalars(tag)
        ]
    texts = {}
    for tag in tags[event_accumulator.TENSORS]:
        meta = acc.SummaryMetadata(tag)
        if meta.plugin_data.plugin_name != "text":
            continue
        texts[tag] = [
            [e.step, tensor_util.make_ndarray(e.tensor_proto).item().decode("utf-8")]
            for e in acc.Tensors(tag)
        ]
    files = sorted(
        f for f in os.listdir(run_dir)
        if io_wrapper.IsSummaryEventsFile(os.path.join(run_dir, f))
    )
    json.dump({"scalars": scalars, "texts": texts, "files": files}, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
