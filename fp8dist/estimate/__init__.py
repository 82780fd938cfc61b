"""Per-rank memory of a run before it starts (`fp8dist estimate MODEL --config X --world-size N`).

The model is built on the meta device (no weights read, no memory), so an 8B or 70B estimate takes
seconds (model.py). Per-parameter bytes of each store come from the audit's expected dtypes for the config
(audit/expected.py `implied_bytes_per_param`, the same rules the audit checks a real run against), then
divided by the mesh axes each engine shards that store over (memory.py, the engine's facts): the data-parallel
ranks, and tp on top for the parameters tensor parallel splits (tensor_parallel.py). Activations are measured on
the meta device: one forward of a `micro_batch_size x seq_len` batch in the compute dtype, summing the tensors
autograd saves for backward (parameters excluded; attention as flash attention keeps it), attributed to the
transformer blocks, so the config's `parallel.activation_checkpointing` can be counted: `full` (every block keeps
its input) and `selective` (its input and the op outputs the engines' selective policy saves), each plus one block
recomputed in backward; on a mesh, for one rank: its `seq_len / cp` tokens, its tp shard of each split Linear, and
under sequence parallel its sequence shard of what the blocks keep outside attention and MLP. The transient peaks
of backward (gathered weights in flight, the logits' gradient) and, from step 2 on, the optimizer's states give the
phase where a rank peaks: its bytes are the one total the estimate gives. Under pipeline parallel each pipeline rank
is counted apart (its stages' parameters, the microbatches its schedule keeps in flight: pipeline.py) and the total
is the heaviest rank's.
The FP8 coverage (coverage.py) predicts the share of weight-GEMM FLOPs the audit will measure in FP8.

Modules: shapes (the built-in model shapes), model (the meta build and the activation measurement; torch imported
only there, when a model is built), tensor_parallel (what the `tp` axis splits), pipeline (what each `pp` rank holds,
the schedules' order), frozen (an adapter run's frozen
base by storage format: a QLoRA base's NF4 Linears at NF4's bytes), coverage (FP8 share and extra bytes), memory
(the memory model, `estimate`), result (the typed `Estimate`), speed (torch-free: will FP8 pay for a Linear on a
GPU; the speed model's constants) and step (with `--gpu`: the predicted step of the config and of its bf16 twin).
Nothing imports this package but fp8dist/commands/ and fp8dist/cli.py (the shape names for the help).
"""
