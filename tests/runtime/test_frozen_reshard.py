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


def test_a_frozen_heavy_unit_fills_only_its_trainable_gradient_and_trains_as_pytorch():
    """Note [trainable flat gradient]: at one rank a unit's backward fills a flat gradient of its trainable elements
    only (a LoRA unit no longer zero-fills its frozen ones: 338 MB a backward for a 2048-wide Llama block), and the
    run still trains as plain PyTorch (planted: the whole unit's flat gradient; the sizes fail)."""
    from engine_runs import train_steps
    from reference import FrozenRecipe, reference_run
    from zero_runs import record_flat_gradients
    recipe = FrozenRecipe(micro_batch=4, steps=3)
    engine = infinity.initialize(recipe.build(), recipe.config(params="host", grads="host", optimizer="host"))
    flats = record_flat_gradients(engine)
    with engine:
        losses = train_steps(engine, recipe, 0, recipe.steps, 0, 1)
        state = engine.full_state_dict()
        units = [(u.padded_numel, u.stored_trainable) for u in engine.units]
    assert all(flat == {trainable} for flat, (_, trainable) in zip(flats, units)), (flats, units)
    assert all(trainable < padded for padded, trainable in units)  # (every unit has frozen weights)
    ref_losses, _, ref_state = reference_run(recipe)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], msg=lambda m, k=name: f"{k}: {m}")


def test_the_byte_model_counts_the_flat_gradient_the_engine_fills():
    """Note [working memory]'s `flat_grad` for units with frozen weights: the largest flat gradient the engine's
    backwards filled (recorded) and one more of its size (its shard at one rank is the whole unit), fp32; before
    2026-11-29 it counted the whole unit twice (planted: the whole unit; this fails)."""
    from engine_runs import train_steps
    from infinity.memory.tier import Tier
    from reference import FrozenRecipe
    from zero_runs import record_flat_gradients
    recipe = FrozenRecipe(micro_batch=4, steps=1)
    engine = infinity.initialize(recipe.build(), recipe.config(params="host", grads="host", optimizer="host"))
    flats = record_flat_gradients(engine)
    with engine:
        train_steps(engine, recipe, 0, 1, 0, 1)
        term = engine.plan.working_terms[Tier.DEVICE]["flat_grad"]
    largest = max(max(f) for f in flats)
    assert term == 2 * largest * 4, (term, largest)
    assert largest < max(u.padded_numel for u in engine.units)
