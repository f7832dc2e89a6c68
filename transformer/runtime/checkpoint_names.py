"""Where a workdir keeps its checkpoints, apart from the orbax code that writes
and reads them (`checkpoints.py`, `averaging.py`): what needs only the names
(the fingerprint of `decoding/serving_params.py`) does not import orbax, 0.2 s
of a decode's start."""

CHECKPOINT_DIR = "checkpoints"  # <workdir>/checkpoints/<step>/: the training checkpoints
AVERAGED_DIR = "checkpoints_averaged"  # <workdir>/checkpoints_averaged/<step>/: their average
