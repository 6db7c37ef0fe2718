"""The ``format`` names of the sealed documents (docs/format.md), in one place for their codecs and for the table of
their older readers (:mod:`.legacy`)."""

#: The record beside a checkpoint object (:class:`~.records.Record`).
CHECKPOINT_FORMAT = "taskpoint.checkpoint"
#: A manager step's manifest (:class:`~.records.StepManifest`).
STEP_FORMAT = "taskpoint.step"
#: The record one rank writes beside its shard of a step (:class:`~.records.ShardRecord`).
SHARD_FORMAT = "taskpoint.shard"
#: The manifest of a file set (:class:`~.fileset.FileSetManifest`).
FILESET_FORMAT = "taskpoint.fileset"
#: The ``kind`` of a PyTorch DCP checkpoint's file-set manifest (:mod:`taskpoint.torch`).
DCP_FILESET_KIND = "torch.dcp"
#: The step kind of a state dict saved by ``torch.save`` (:mod:`taskpoint.torch`), whose older content
#: :mod:`.legacy` reads.
STATE_DICT_KIND = "torch.state_dict"
