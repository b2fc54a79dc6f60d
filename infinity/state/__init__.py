"""Model state in and out of the runtime: pretrained weights read shard by shard (weights.py), sharded
checkpoints and their small files (checkpoint.py, checkpoint_files.py), consolidated and Hugging Face exports
(export.py), the gathered state dict (state_dict.py)."""
