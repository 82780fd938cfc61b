"""What `fp8dist audit` / `compare` say when a rank dies with an exception nobody caught: the rank's own error,
not torchrun's traceback of itself that follows it (torch 2.13's agent re-raises ChildFailedError)."""
from fp8dist.runtime.ranks import failure_tail

RANK_TRACEBACK = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/x/fp8dist/commands/audit_worker.py", line 70, in <module>
[rank0]:   File "/x/torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py", line 1018, in fsdp_post_all_gather
[rank0]:     (quantized_scalers, quantization_factor, quantized_data) = all_gather_outputs
[rank0]: ValueError: not enough values to unpack (expected 3, got 1)
"""
LAUNCHER_REPORT = """\
E1126 15:23:11.672000 2778 site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 0 (pid: 2823) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/site-packages/torch/distributed/run.py", line 1032, in <module>
    main()
    return f(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^
  File "/x/site-packages/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "/x/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
fp8dist.commands.audit_worker FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 2823)
============================================================
"""


def test_the_ranks_error_ends_the_tail_not_the_launchers_traceback():
    tail = failure_tail("some progress\n" + RANK_TRACEBACK + LAUNCHER_REPORT)
    assert tail.splitlines()[-1] == "[rank0]: ValueError: not enough values to unpack (expected 3, got 1)"
    assert "torch/distributed/run.py" not in tail and "ChildFailedError" not in tail and "FAILED" not in tail


def test_output_without_a_launcher_report_keeps_its_end():
    output = "\n".join(f"line {i}" for i in range(30))
    assert failure_tail(output, lines=3) == "line 27\nline 28\nline 29"
