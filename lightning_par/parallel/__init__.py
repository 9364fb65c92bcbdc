"""Pure-torch parallel transforms, one folder per technique; nothing here imports Lightning.

Technique folders: `tensor/` (tensor and sequence parallel, with the tp plan it infers), `pipeline/` (the stage cut,
the stages and their schedules), `zero/` (FSDP2 for stage 3, the replicated engine for stages 0-2), `experts/` (the
MoE finder and expert parallelism), `context/` (context parallelism), `deepspeed/` (ZeRO through DeepSpeed),
`local_sgd/` (DiLoCo). Beside them, what several techniques share (`collectives`, `grad_norm`, `optimizers`,
`param_tree`, `parts`, `rebind`, `materialize`, `activation_checkpointing`, `compile`, `flops`, `comm_counter`) and
`compose.parallelize`, which applies the techniques in their order and returns a `run.ParallelRun`. House rule
(`tests/test_structure.py`): at most 15 modules in a folder, no cycle between the folders.
"""
