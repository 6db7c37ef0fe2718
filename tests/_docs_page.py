"""Run one documentation page's python blocks, in order, in one namespace, as a reader runs them
(tests/e2e/test_docs.py): ``python _docs_page.py BLOCKS.json``, where the file lists ``{"where", "code"}``.

Each block is compiled under its markdown location, so a traceback names it, and a ``--- where`` line is printed
before it. The page sees the ``sys.path`` of ``python -c`` (its working directory first, not this file's folder),
whether this runs as a process of its own or forked from tests/_zygote.py's server.
"""

import json
import sys

if __name__ == "__main__":
    with open(sys.argv[1], encoding="utf-8") as listed:
        blocks = json.load(listed)
    sys.path[0] = ""  # as python -c: the working directory
    namespace = {"__name__": "__main__"}
    for block in blocks:
        print(f"--- {block['where']}", flush=True)
        exec(compile(block["code"], block["where"], "exec"), namespace)
