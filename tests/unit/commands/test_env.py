"""`fp8dist env`'s verdicts per backend, from versions and device facts (pure inputs)."""
import fp8dist.commands.env as environment
CPU = {"cuda_available": False, "name": None, "capability": None, "cuda": None}
H200 = {"cuda_available": True, "name": "NVIDIA H200", "capability": [9, 0], "cuda": "12.8"}
H100 = {**H200, "name": "NVIDIA H100 80GB HBM3"}


def status(device, importable=True, monkeypatch=None, **versions):
    if monkeypatch is not None:
        monkeypatch.setattr(environment, "_importable", lambda module: (importable, "imports" if importable else
                                                                         f"`import {module}` fails: OSError: x"))
    return environment.backend_status({"torch": "2.13.0", **versions}, device)


def test_cpu_machine_says_why_te_and_msamp_cannot_run():
    out = status(CPU, deepspeed="0.19.8", torchao="0.18.0")
    assert out["torchao_float8"]["usable"] and not out["torchao_float8"]["native_fp8"]
    assert "emulate=true" in out["torchao_float8"]["reason"]
    assert not out["transformer_engine"]["usable"] and "needs CUDA" in out["transformer_engine"]["reason"]
    msamp = out["msamp"]
    assert not msamp["usable"] and "not on PyPI" in msamp["reason"] and "0.19.8 is outside" in msamp["reason"]


def test_msamp_in_its_window_on_h200_is_usable_but_emulates_gemms(monkeypatch):
    out = status(H200, monkeypatch=monkeypatch, deepspeed="0.13.1", msamp="0.4.0")["msamp"]
    assert out["usable"] and "pinned, tested" in out["reason"] and "emulated in 16-bit" in out["reason"]
    out = status(H100, monkeypatch=monkeypatch, deepspeed="0.13.1", msamp="0.4.0")["msamp"]
    assert out["usable"] and "emulated" not in out["reason"]


def test_msamp_against_a_deepspeed_outside_its_release_window(monkeypatch):
    out = status(H100, monkeypatch=monkeypatch, deepspeed="0.9.2", msamp="0.4.0")["msamp"]
    assert not out["usable"] and "installed MS-AMP 0.4.0" in out["reason"]


def test_te_installed_but_unimportable_or_on_old_gpus(monkeypatch):
    out = status(H200, importable=False, monkeypatch=monkeypatch, transformer_engine="2.20.2")
    assert not out["transformer_engine"]["usable"] and "fails" in out["transformer_engine"]["reason"]
    a100 = {**H200, "name": "NVIDIA A100", "capability": [8, 0]}
    out = status(a100, monkeypatch=monkeypatch, transformer_engine="2.20.2")["transformer_engine"]
    assert not out["usable"] and "8.0" in out["reason"]
    assert status(H200, monkeypatch=monkeypatch, transformer_engine="2.20.2")["transformer_engine"]["usable"]


def _line(info, backend):
    return next(line for line in environment.render(info).splitlines() if f" {backend} " in line)


def test_the_table_says_emulation_only_where_fp8_runs_without_fp8_kernels(monkeypatch):
    def info(device, **versions):
        return {"python": "3.11", "platform": "linux", "versions": {}, "device": device,
                "backends": status(device, monkeypatch=monkeypatch, **versions)}

    cpu = info(CPU, torchao="0.18.0")
    assert _line(cpu, "torchao_float8").startswith("emulation only ")
    assert _line(cpu, "fsdp2").startswith("yes ") and _line(cpu, "transformer_engine").startswith("no ")
    assert _line(info(H100, torchao="0.18.0"), "torchao_float8").startswith("yes ")
    on_h200 = info(H200, deepspeed="0.13.1", msamp="0.4.0")  # MS-AMP's GEMMs are FP8 on H100 only
    assert _line(on_h200, "msamp").startswith("emulation only ")
    assert _line(info(H100, deepspeed="0.13.1", msamp="0.4.0"), "msamp").startswith("yes ")
