"""Note [unit backward done]: a unit with frozen weights reshards when its backward is over, not at the end of
the whole backward, so a fine-tune holds about units_ahead + 2 blocks' parameters, not the model's."""

import torch

import infinity
from infinity.models.gpt import GPT, GPTConfig, synthetic_batch


def test_blocks_with_frozen_weights_reshard_during_backward(tmp_path):
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=8, n_head=2, d_model=64)
    with infinity.meta_init():
        model = GPT(cfg)
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("fc.weight"))  # every block mixes frozen and trainable weights
    units_ahead = 1
    engine = infinity.initialize(model, {"placement": {"params": "nvme", "grads": "host", "optimizer": "host"},
                                         "nvme": {"paths": [str(tmp_path)]},
                                         "prefetch": {"units_ahead": units_ahead}})
    x, y = synthetic_batch(cfg, 2, torch.Generator().manual_seed(0))
    with engine:
        for _ in range(2):
            engine.backward(engine(x, y))
            engine.step()
        report = engine.memory_report()
        page = 4096  # the CPU pool's buffers are page-aligned (Note [unsharded memory])
        block = -(-max(u.padded_numel for u in engine.units[1:]) * 4 // page) * page  # the largest block, fp32
        root = -(-engine.units[0].padded_numel * 4 // page) * page
    # the root, the block computing, and units_ahead + 1 prefetched around it: never all 8 blocks
    assert report["unsharded_pool_bytes"] <= root + (units_ahead + 2) * block, (report["unsharded_pool_bytes"],
                                                                                root, block)
