"""Generation and evaluation forwards outside engine(batch), at every placement (Note [inference forwards]).

The reference is transformers itself: the same weights (saved by save_pretrained, loaded with weights=) in
the plain model, greedy decoding by its own generate(); evaluation logits by its own forward.
"""

from __future__ import annotations

import pytest
import torch

import infinity
from hf_tiny import HOST, nvme, on_meta, prompt, reference, train

NEW_TOKENS = 4  # the prompt's 12 + 4 stay within the tiny models' 16 positions


def placement(tier: str, swap) -> dict:
    if tier == "nvme":
        return nvme(str(swap))
    if tier == "device":
        return {**HOST, "placement": {"params": "device", "grads": "device", "optimizer": "device"}}
    return HOST


def greedy(generate, x):
    return generate(x, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each kind's reference model and its save_pretrained directory."""
    out = {}
    for kind in ("llama", "gpt2"):
        ref = reference(kind)
        path = tmp_path_factory.mktemp(kind)
        ref.save_pretrained(path)
        out[kind] = (ref, str(path))
    return out


@pytest.mark.parametrize("tier", ["nvme", "host", "device"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_greedy_generation_equals_the_plain_model(kind, tier, saved, tmp_path):
    ref, path = saved[kind]
    x = prompt()
    with torch.no_grad():
        want = greedy(ref.generate, x)
    with infinity.initialize(on_meta(kind), placement(tier, tmp_path), weights=path) as engine:
        got = greedy(engine.generate, x)
        again = greedy(engine.generate, x)  # a second generate: the root was released and is fetched again
        assert not engine.units[0].state.name.startswith("UNSHARD")  # released after generate
    assert torch.equal(got.cpu(), want) and torch.equal(again.cpu(), want)  # (the engine's on its device)


@pytest.mark.parametrize("extra", [{"zero": {"stage": 2}}, {"activation": {"checkpoint": "units"}}],
                         ids=["stage2", "checkpointed"])
def test_generation_with_parameters_on_nvme_at_other_settings(extra, saved, tmp_path):
    ref, path = saved["llama"]
    x = prompt()
    with torch.no_grad():
        want = greedy(ref.generate, x)
    with infinity.initialize(on_meta("llama"), nvme(str(tmp_path)) | extra, weights=path) as engine:
        assert torch.equal(greedy(engine.generate, x), want)


def test_evaluation_through_the_module_under_no_grad(saved, tmp_path):
    """engine.module(...) called directly (a user's eval loop) with parameters on NVMe: transformers' logits."""
    ref, path = saved["llama"]
    x = prompt()
    with torch.no_grad():
        want = ref(input_ids=x).logits
    with infinity.initialize(on_meta("llama"), nvme(str(tmp_path)), weights=path) as engine:
        with torch.no_grad():
            got = engine.module(input_ids=x).logits
            via_engine = engine(input_ids=x).logits
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(via_engine, want)
        with pytest.raises(RuntimeError, match="needs gradients.*torch.no_grad"):
            engine.module(input_ids=x)  # with gradients, outside engine(batch): refused with the fix
        with torch.no_grad():  # and the engine still works after the refusal
            torch.testing.assert_close(engine.module(input_ids=x).logits, want)
        loss = engine(input_ids=x, labels=x).loss  # a training forward waits for its backward:
        with torch.no_grad(), pytest.raises(RuntimeError, match="call engine.backward"):
            engine.module(input_ids=x)  # an evaluation now would release the root it needs
        engine.backward(loss)


@pytest.mark.parametrize("overlap", [False, True], ids=["inline", "worker"])
def test_evaluation_and_generation_leave_training_bitwise_unchanged(overlap, saved, tmp_path):
    """Training with an evaluation forward and a generate after every step ends with the very parameters of the
    same training without them; and no gradient state is allocated by them."""
    _, path = saved["llama"]
    config = nvme(str(tmp_path)) | {"overlap": {"optimizer_with_backward": overlap}, "optimizer": {
        "lr": 1e-2, "weight_decay": 0.1, "grad_clip": 0.5 if overlap else 0.0}}
    x = prompt()
    finals = []
    for interleave in (False, True):
        with infinity.initialize(on_meta("llama"), config, weights=path) as engine:
            for _ in range(3):
                train(engine, steps=1)
                if interleave:
                    grads_before = [u.grads.flat is None for u in engine.units]
                    with torch.no_grad():
                        engine.module(input_ids=x)
                    greedy(engine.generate, x)
                    assert [u.grads.flat is None for u in engine.units] == grads_before
            finals.append(engine.full_state_dict())
    for key, value in finals[0].items():
        assert torch.equal(value, finals[1][key]), key


def test_generation_of_a_peft_model_on_nvme(saved, tmp_path):
    """A LoRA-wrapped model's generate (PEFT calls its base model's): with B = 0 the adapters add nothing, so
    the base model's greedy tokens."""
    peft = pytest.importorskip("peft")
    ref, path = saved["llama"]
    x = prompt()
    with torch.no_grad():
        want = greedy(ref.generate, x)
    base = on_meta("llama")
    with infinity.meta_init():
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with infinity.initialize(model, nvme(str(tmp_path)), weights=path) as engine:
        assert torch.equal(greedy(engine.generate, x), want)


def test_generate_needs_a_model_with_generate(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with infinity.initialize(model, HOST) as engine:
        with pytest.raises(TypeError, match="has none.*torch.no_grad"):
            engine.generate(torch.zeros(1, 4))


@pytest.mark.parametrize("tier,stage,checkpoint", [("nvme", 3, "none"), ("nvme", 0, "units"), ("host", 2, "units"),
                                                   ("device", 1, "none")])
def test_evaluation_loss_at_each_stage_equals_transformers_and_allocates_no_gradients(tier, stage, checkpoint,
                                                                                      saved, tmp_path):
    """An evaluation loop's loss (engine(batch) and engine.module under no_grad) at stages 0-3: transformers'
    loss on the same weights, with no gradient buffer allocated and no backward owed."""
    ref, path = saved["llama"]
    x = prompt()
    with torch.no_grad():
        want = ref(input_ids=x, labels=x).loss
    config = placement(tier, tmp_path) | {"zero": {"stage": stage}, "activation": {"checkpoint": checkpoint}}
    with infinity.initialize(on_meta("llama"), config, weights=path) as engine:
        engine.eval()
        with torch.no_grad():
            for forward in (engine, engine.module):
                torch.testing.assert_close(forward(input_ids=x, labels=x).loss, want, rtol=1e-5, atol=1e-6)
        assert all(u.grads.flat is None and not u.grads.slots_with_grad for u in engine.units)
        assert all(p.grad is None for p in engine.module.parameters())
        with pytest.raises(RuntimeError, match="needs a forward with gradients"):
            engine.backward(torch.zeros(()))


def test_inference_mode_forwards_then_training_continues(saved, tmp_path):
    """torch.inference_mode (stricter than no_grad) for an evaluation forward and a generate; the buffers they
    unsharded are not inference tensors, so the next training step runs."""
    ref, path = saved["llama"]
    x = prompt()
    with torch.no_grad():
        want_logits, want_tokens = ref(input_ids=x).logits, greedy(ref.generate, x)
    with infinity.initialize(on_meta("llama"), nvme(str(tmp_path)), weights=path) as engine:
        engine.eval()
        with torch.inference_mode():
            logits = engine.module(input_ids=x).logits
            tokens = greedy(engine.generate, x)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-6)
        assert torch.equal(tokens, want_tokens)
        engine.train()
        engine.backward(engine(input_ids=x, labels=x).loss)
        assert engine.step()


def _generate_on_rank(rank, world_size, path, swap):
    import os
    os.makedirs(f"{swap}/{rank}", exist_ok=True)
    config = nvme(f"{swap}/{rank}") | {"zero": {"stage": 3}}
    with infinity.initialize(on_meta("gpt2"), config, weights=path) as engine:
        return greedy(engine.generate, prompt())


@pytest.mark.slow
def test_world_2_stage_3_generation_equals_transformers(saved, tmp_path):
    """Each rank holds half of every parameter on its NVMe; generate all-gathers them unit by unit."""
    from dist_utils import run_distributed
    ref, path = saved["gpt2"]
    with torch.no_grad():
        want = greedy(ref.generate, prompt())
    for got in run_distributed(_generate_on_rank, 2, path, str(tmp_path)):
        assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_greedy_generation_with_parameters_on_nvme(saved, tmp_path):
    """The GPU twin (issue 42): engine.generate with the parameters on NVMe, on the device, against the plain
    model's greedy tokens."""
    test_greedy_generation_equals_the_plain_model("llama", "nvme", saved, tmp_path)
