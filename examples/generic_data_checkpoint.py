"""A plain function with retries that saves its loop index as bytes and resumes from it.

    python examples/generic_data_checkpoint.py --items 50 --fail-at 17 --fail-at 33

Each ``--fail-at N`` makes one attempt fail when it reaches item N (after the checkpoint of the items
before it), in order; the next attempt resumes at the saved index instead of starting over.
"""

from __future__ import annotations

import argparse
import hashlib

import taskpoint


def process(item: int) -> bytes:
    """Stand-in for real work on one item."""
    return hashlib.sha256(f"item-{item}".encode()).digest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--fail-at", type=int, action="append", default=[], help="fail one attempt at this item")
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--run-name", default=None)
    args = parser.parse_args()
    failures = list(args.fail_at)

    @taskpoint.task(retries=args.retries, run_name=args.run_name)
    def digest_all(n: int) -> str:
        c = taskpoint.ctx()
        assert c is not None and c.checkpoint is not None
        prev = c.checkpoint.load_sync()
        # The checkpoint holds "index:running digest", as bytes.
        index, acc = (prev.read_text().split(":") if prev else ("0", hashlib.sha256().hexdigest()))
        start = int(index)
        print(f"attempt {c.attempt}: resumed at item {start}", flush=True)
        for item in range(start, n):
            if failures and item == failures[0]:
                failures.pop(0)
                raise RuntimeError(f"simulated failure at item {item}")
            acc = hashlib.sha256(bytes.fromhex(acc) + process(item)).hexdigest()
            c.checkpoint.save_sync(f"{item + 1}:{acc}".encode())
        return acc

    print(f"result: {digest_all(args.items)}")


if __name__ == "__main__":
    main()
