"""What fp8dist knows about the libraries it runs and the hardware they need, one module per library, each fact
with its source (an upstream file and release, a pull request or a public URL).

Pure data and pure functions: versions and compute capabilities come in as arguments, answers go out as
``(ok, reason)``. Nothing here imports torch, the libraries described, or any other part of fp8dist (every layer
reads these modules; tests/unit/test_architecture.py keeps them free of fp8dist imports), so the light commands
(validate, translate, schema, import, estimate) read them without starting torch.

- versions: version tuples and the installed release of a distribution (package metadata, no import);
- hardware: the compute capabilities FP8 GEMMs need;
- torch, torchao, deepspeed, transformer_engine, msamp, accelerate, peft, transformers: one per library.

What another tool's importer resolves a left-out key to lives beside that importer's key table
(fp8dist/formats/<tool>/), not here: those are defaults of files fp8dist reads, not of libraries it runs.
"""
