"""One rank of tests/test_group.py: ``python tests/_group_worker.py ARGS_JSON``, its rank from the environment
(``TASKPOINT_RANK``/``TASKPOINT_WORLD_SIZE``, or torchrun's variables).

ARGS_JSON: ``group`` (``"storage"``: a :class:`~taskpoint.group.StorageGroup` in ``folder`` of round ``round``;
``"torch"``: a :class:`~taskpoint.group.TorchGroup` on a gloo process group), ``timeout`` (each collective's bound)
and ``dies`` (a rank that ends right after the first collective: the others then wait for it in a second one).
Each rank prints one JSON line, in one write: ``{"rank", "results"}``, or ``{"rank", "error", "message",
"missing", "gone"}`` when a collective failed.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from taskpoint.group import StorageGroup, TorchGroup
from taskpoint.ranks import ranks_from_environment
from taskpoint.storage import Location


def _say(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


def main(args: dict[str, Any]) -> None:
    ranks = ranks_from_environment()
    group: StorageGroup | TorchGroup | None
    if args["group"] == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = TorchGroup.of_initialized(args["timeout"], "a test of the group")
        assert group is not None
    else:
        group = StorageGroup(Location(args["folder"]), ranks, args["round"], args["timeout"])
    rank = ranks.rank
    try:
        results: dict[str, Any] = {"all_gather": group.all_gather({"rank": rank, "twice": 2 * rank}, "first")}
        if rank == args.get("dies"):
            _say({"rank": rank, "event": "ending"})
            os._exit(0)
        results["broadcast"] = group.broadcast(f"from rank {rank}", "second", src=ranks.world_size - 1)
        group.barrier("third")
        if isinstance(group, TorchGroup):
            results["start_max"] = group.start_max(rank + 1, "fourth")(None)
        _say({"rank": rank, "results": results})
    except Exception as exc:  # reported to the test, which checks it
        _say({"rank": rank, "error": type(exc).__name__, "message": str(exc),
              "missing": getattr(exc, "missing", None), "gone": getattr(exc, "gone", None)})
    sys.stdout.flush()
    os._exit(0)  # no process group shutdown: a rank that died would hold it


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
