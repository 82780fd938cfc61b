"""MODEL factories for launch/train.py that inject a fault (`--model tests.fault_injection:NAME`)."""
import os
import signal

from fp8dist.runtime.models import load_model


def tiny_llama_killed_in_save():
    """tiny-llama, where rank $FP8DIST_KILL_RANK SIGKILLs itself inside the save of step $FP8DIST_KILL_AT_STEP:
    after its DCP shards are written, before the checkpoint is complete (no rank file, no manifest). Without
    those variables, the same model and no fault."""
    import fp8dist.engines.fsdp2 as fsdp2

    if os.environ.get("RANK", "0") == os.environ.get("FP8DIST_KILL_RANK"):
        write, doomed = fsdp2.Checkpointing.write, f".step-{int(os.environ['FP8DIST_KILL_AT_STEP']):08d}.partial"

        def write_then_die(self, directory):
            write(self, directory)
            if directory.name == doomed:
                os.kill(os.getpid(), signal.SIGKILL)

        fsdp2.Checkpointing.write = write_then_die
    return load_model("tiny-llama", "fp32").model
