"""ZeRO through DeepSpeed: the config and engine (`engine`), meta-device initialisation (`meta_init`) and its state in
checkpoints (`state`). Pure torch + DeepSpeed, no Lightning."""
