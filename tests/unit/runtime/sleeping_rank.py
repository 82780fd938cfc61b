"""A rank that only says it started (tests/unit/runtime/test_rank_timeout.py): writes its pid into DIR as
`rank<RANK>.pid`, then sleeps past any bound. Run as `fp8dist.runtime.ranks.launch` runs a rank module:
`python -m tests.unit.runtime.sleeping_rank DIR OUT.json` under torchrun. Imports nothing heavy, so it starts fast."""
import os
import sys
import time

directory = sys.argv[1]
with open(os.path.join(directory, f"rank{os.environ['RANK']}.pid.tmp"), "w", encoding="utf-8") as handle:
    handle.write(str(os.getpid()))
os.replace(os.path.join(directory, f"rank{os.environ['RANK']}.pid.tmp"),
           os.path.join(directory, f"rank{os.environ['RANK']}.pid"))
time.sleep(3600)
