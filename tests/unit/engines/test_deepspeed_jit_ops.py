"""DeepSpeed's JIT-built C++ ops (fp8dist/engines/deepspeed/jit_ops.py): a first build is said before it starts,
a built op is not, and a build lock a stopped build left behind is refused naming the file and the fix, instead
of a run that hangs without a word (issue 46, item 10)."""
import os
import time

import pytest

from fp8dist.engines.deepspeed import jit_ops
from fp8dist.errors import UnsupportedEnvironment


@pytest.fixture
def extensions(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(jit_ops, "_said", set())
    return tmp_path


def test_a_first_build_is_said_once_with_the_folder_it_is_kept_in(extensions, capsys):
    jit_ops.say_builds((jit_ops.SHM_COMM,))
    jit_ops.say_builds((jit_ops.SHM_COMM,))
    err = capsys.readouterr().err
    assert err.count("DeepSpeed builds its deepspeed_shm_comm C++ op") == 1, err
    assert f"later runs load it from {extensions / 'deepspeed_shm_comm'}" in err


def test_a_built_op_is_not_said(extensions, capsys):
    folder = jit_ops.build_folder("cpu_adam")
    (folder / "cpu_adam.so").write_bytes(b"")
    jit_ops.say_builds((jit_ops.CPU_ADAM,))
    assert capsys.readouterr().err == ""


def test_a_stale_build_lock_is_refused_with_the_file_and_the_fix(extensions):
    lock = jit_ops.build_folder("deepspeed_shm_comm") / "lock"
    lock.write_text("")
    old = time.time() - 2 * jit_ops.STALE_LOCK_S
    os.utime(lock, (old, old))
    with pytest.raises(UnsupportedEnvironment) as refused:
        jit_ops.say_builds((jit_ops.SHM_COMM,))
    message = str(refused.value)
    assert f"{lock} is a build lock left 20 minutes ago" in message and "fix: make sure no other run" in message
    assert f"rm {lock}" in message


def test_a_fresh_lock_is_a_build_in_progress(extensions, capsys):
    (jit_ops.build_folder("deepspeed_shm_comm") / "lock").write_text("")
    jit_ops.say_builds((jit_ops.SHM_COMM,))  # another rank or run is building it: torch waits for it, rightly
    assert "builds its deepspeed_shm_comm" in capsys.readouterr().err
