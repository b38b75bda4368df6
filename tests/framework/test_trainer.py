"""PALUTrainer in-process: what changes in a few steps, what must not, and argument checks."""

import dataclasses
import logging

import pytest
import torch

from palu_trainer.framework.checkout import ensure_importable
from palu_trainer.method.reference_cache import ReferenceCache, count_positions, estimated_nbytes
from palu_trainer.method.roles import count_roles
from palu_trainer.training.run_guard import RunStopped

ensure_importable()

from palu_trainer.framework.trainers.palu import REFERENCE_CACHE_FILE, PALUTrainer  # noqa: E402


def test_training_moves_the_model_and_never_the_reference(make_trainer):
    trainer = make_trainer(top_k=64, reference_cache=False)
    reference_before = {name: p.detach().clone() for name, p in trainer.ref_model.named_parameters()}
    model_before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    for name, parameter in trainer.ref_model.named_parameters():
        assert torch.equal(parameter, reference_before[name]), name
        assert not parameter.requires_grad or parameter.grad is None
    moved = [name for name, p in trainer.model.named_parameters() if not torch.equal(p, model_before[name])]
    assert len(moved) == len(model_before)
    logged = [entry for entry in trainer.state.log_history if "local_loss" in entry]
    forget_roles = [item["token_roles"] for item in trainer.train_dataset.forget.items]
    assert len(logged) == 3  # one batch holds the whole forget set
    assert logged[0]["n_initiating"] == sum(count_roles(roles)["n_initiating"] for roles in forget_roles) > 0


def test_cached_run_keeps_no_reference_model(make_trainer):
    trainer = make_trainer(max_steps=2, top_k=64)
    assert trainer.uses_reference_cache and trainer.ref_model is None
    trainer.train()
    assert trainer.ref_model is None
    cache = trainer.reference_cache
    assert sorted(cache.initiating["topk_indices"]) == [0, 1, 2]
    assert cache.initiating["topk_indices"][2].shape == (0, 64)  # the no-information row: no initiating token
    assert (
        cache.common["common"][0].shape[1]
        == trainer.reference_cache_top_m
        == 512
        < trainer.model.config.vocab_size
    )
    positions = count_positions(item["token_roles"] for item in trainer.train_dataset.forget.items)
    assert estimated_nbytes(*positions, 64, 512, torch.float32) == cache.nbytes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_reference_cache_travels_in_a_checkpoint_file_unchanged(make_trainer, tmp_path, dtype):
    """Saved as safetensors (no pickle) with its settings and read back, every row's tables are equal, the
    empty one included, and so are a batch's targets."""
    trainer = make_trainer(max_steps=1, top_k=64, reference_cache_dtype=dtype)
    trainer.train()
    cache, path = trainer.reference_cache, tmp_path / REFERENCE_CACHE_FILE
    cache.save(path, {"top_k": "64"})
    loaded, settings = ReferenceCache.load(path)
    assert settings == {"top_k": "64"} and loaded.kl_direction == cache.kl_direction
    for part in ("initiating", "common"):
        tables, loaded_tables = getattr(cache, part), getattr(loaded, part)
        assert tables.keys() == loaded_tables.keys()
        for name, table in tables.items():
            assert table.keys() == loaded_tables[name].keys()
            for row, tensor in table.items():
                assert loaded_tables[name][row].dtype == tensor.dtype
                assert torch.equal(loaded_tables[name][row], tensor), (part, name, row)
    batch = trainer.data_collator([trainer.train_dataset.forget[i] for i in range(3)])
    before = cache.targets(batch["index"], batch["token_roles"], "cpu")
    after = loaded.targets(batch["index"], batch["token_roles"], "cpu")
    for name, value in vars(after.initiating_targets).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(before.initiating_targets, name)), name


def loss_and_gradients(trainer, batch):
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters()}


def drift(*models, seed=0):
    """The same parameter change on each model: the policy away from the reference, as after training."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameters in zip(*(model.parameters() for model in models)):
            change = 0.05 * torch.randn(parameters[0].shape, generator=generator)
            for parameter in parameters:
                parameter.add_(change)


RELEASE_FORM = {
    "target_gradient": True,
    "kl_direction": "policy_to_ref",
    "kl_weight": "alpha",
    "merge_adjacent_spans": True,
}


@pytest.mark.parametrize("form", ["paper", "release"])
def test_cache_gives_the_uncached_loss_and_gradients(make_trainer, form):
    """At step 0 the top-m form is exact: the reference is the policy, P_θ = P_ref."""
    method_args = RELEASE_FORM if form == "release" else {}
    policy = {"merge_adjacent_spans": True} if form == "release" else None
    cached = make_trainer(top_k=64, policy=policy, **method_args)
    uncached = make_trainer(top_k=64, reference_cache=False, policy=policy, **method_args)
    dataset = cached.train_dataset
    torch.manual_seed(0)
    batches = [cached.data_collator([dataset[i] for i in rows]) for rows in ([0, 1], [2, 0], [1])]
    for batch in batches:
        cached_loss, cached_grads = loss_and_gradients(cached, batch)
        uncached_loss, uncached_grads = loss_and_gradients(uncached, batch)
        torch.testing.assert_close(cached_loss, uncached_loss, rtol=1e-5, atol=0)
        for name, gradient in uncached_grads.items():
            torch.testing.assert_close(cached_grads[name], gradient, rtol=1e-5, atol=1e-7, msg=name)
    cache = cached.reference_cache
    assert sorted(cache.common["common"]) == [0, 1, 2]
    # log P_ref for KL(P_theta || P_ref) (no KL constant), P_ref and its KL constant for the paper's direction
    assert cache.kl_direction == ("policy_to_ref" if form == "release" else "ref_to_policy")
    assert ("neg_entropy" in cache.common) == (form == "paper")
    first = cache.common["common"][0]
    assert (first <= 0).all() if form == "release" else ((first >= 0) & (first <= 1)).all()


@pytest.mark.parametrize("form", ["paper", "release"])
def test_cache_with_all_entries_stays_exact_after_the_policy_moves(make_trainer, form):
    """Past step 0 the top-m form is exact when m = |V| (no tail), in both KL directions."""
    method_args = RELEASE_FORM if form == "release" else {}
    policy = {"merge_adjacent_spans": True} if form == "release" else None
    cached = make_trainer(top_k=64, reference_cache_top_m=10**6, policy=policy, **method_args)
    uncached = make_trainer(top_k=64, reference_cache=False, policy=policy, **method_args)
    assert cached.reference_cache_top_m == cached.model.config.vocab_size
    batch = cached.data_collator([cached.train_dataset[i] for i in (0, 1, 2)])
    cached.compute_loss(cached.model, batch)  # builds the cache from the step-0 weights
    drift(cached.model, uncached.model)
    cached_loss, cached_grads = loss_and_gradients(cached, batch)
    uncached_loss, uncached_grads = loss_and_gradients(uncached, batch)
    assert float(uncached._term_sums[1]) > 1e-3  # the KL term is not zero once the policy moved
    torch.testing.assert_close(cached_loss, uncached_loss, rtol=1e-4, atol=0)
    for name, gradient in uncached_grads.items():
        torch.testing.assert_close(cached_grads[name], gradient, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(("reference_cache", "form"), [(True, "paper"), (False, "paper"), (True, "release")])
def test_projection_at_positions_gives_the_full_logits_losses_and_gradients(
    make_trainer, reference_cache, form
):
    """Logits only at the loss positions, 2 positions per checkpointed chunk, against full logits."""
    method_args = RELEASE_FORM if form == "release" else {}
    policy = {"merge_adjacent_spans": True} if form == "release" else None
    fast = make_trainer(top_k=64, reference_cache=reference_cache, policy=policy, **method_args)
    full = make_trainer(top_k=64, reference_cache=reference_cache, policy=policy, **method_args)
    full.projects_at_positions = False
    assert fast.projects_at_positions and fast.objective.chunk_rows == 2048  # 2**22 logits of |V| = 2048
    fast.objective = dataclasses.replace(fast.objective, chunk_rows=2)
    batch = fast.data_collator([fast.train_dataset[i] for i in (0, 1, 2)])
    for trainer in (fast, full):
        trainer.compute_loss(trainer.model, batch)
    drift(fast.model, full.model, *(t.ref_model for t in (fast, full) if t.ref_model is not None))
    drift(fast.model, full.model, seed=1)
    fast_loss, fast_grads = loss_and_gradients(fast, batch)
    full_loss, full_grads = loss_and_gradients(full, batch)
    terms = [t._term_sums[:3] / t._term_sums[-1] for t in (fast, full)]
    torch.testing.assert_close(*terms, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fast_loss, full_loss, rtol=1e-5, atol=0)
    for name, gradient in full_grads.items():  # atol: 1e-5 of each gradient's scale (fp32 summation order)
        scale = float(gradient.abs().max())
        torch.testing.assert_close(fast_grads[name], gradient, rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_cache_refuses_weights_past_the_first_step(make_trainer):
    trainer = make_trainer(top_k=64)
    trainer.state.global_step = 5
    batch = trainer.data_collator([trainer.train_dataset[0]])
    with pytest.raises(
        RuntimeError,
        match=r"at step 5: resume through train\(resume_from_checkpoint=...\), which builds it first",
    ):
        trainer.compute_loss(trainer.model, batch)


@pytest.mark.parametrize("form", ["paper", "release"])
def test_cache_estimate_is_the_built_cache_and_auto_falls_back_above_the_budget(make_trainer, caplog, form):
    method_args = RELEASE_FORM if form == "release" else {}
    policy = {"merge_adjacent_spans": True} if form == "release" else None
    trainer = make_trainer(max_steps=1, top_k=64, reference_cache_top_m=100, policy=policy, **method_args)
    trainer.train()
    positions = count_positions(item["token_roles"] for item in trainer.train_dataset.forget.items)
    estimate = estimated_nbytes(*positions, 64, 100, torch.float32, trainer.objective.kl_direction)
    assert estimate == trainer.reference_cache.nbytes
    budget_gib = estimate / 2**30 * 0.99
    with caplog.at_level(logging.INFO, logger="palu_trainer.framework.trainers.palu"):
        over = make_trainer(
            top_k=64,
            reference_cache_top_m=100,
            reference_cache_max_gib=budget_gib,
            policy=policy,
            **method_args,
        )
    assert not over.uses_reference_cache and over.ref_model is not None
    assert f"estimated at {estimate / 2**30:.3f} GiB" in caplog.text
    assert f"reference_cache_max_gib={budget_gib:g}: keeping the reference model instead" in caplog.text
    forced = make_trainer(top_k=64, reference_cache=True, reference_cache_max_gib=budget_gib)
    assert forced.uses_reference_cache  # an explicit `true` is obeyed


def test_kl_retain_keeps_the_reference_model(make_trainer):
    trainer = make_trainer(retain_loss_type="KL")
    assert not trainer.uses_reference_cache and trainer.ref_model is not None


def policy_forward_batches(trainer) -> list[int]:
    """Trains and returns the batch size of every forward of the policy model."""
    batches = []
    hook = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: batches.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    trainer.train()
    hook.remove()
    return batches


@pytest.mark.parametrize("retain_loss_type", ["none", "NLL"])
def test_retain_none_skips_the_retain_forward(make_trainer, retain_loss_type):
    steps = 2
    trainer = make_trainer(max_steps=steps, retain_loss_type=retain_loss_type, kl_weight=0.0, top_k=64)
    forwards = policy_forward_batches(trainer)
    cache_build = 1  # the reference cache is built with the policy's weights before the first step
    assert len(forwards) == cache_build + steps * (1 if retain_loss_type == "none" else 2)
    (logged, *_) = [entry for entry in trainer.state.log_history if "local_loss" in entry]
    if retain_loss_type == "none":
        assert logged["retain_loss"] == 0.0 and logged["loss"] == pytest.approx(
            logged["local_loss"], rel=1e-3
        )
    else:
        assert logged["retain_loss"] > 0.0


def test_top_k_is_capped_at_the_vocabulary(make_trainer, caplog):
    with caplog.at_level(logging.WARNING, logger="palu_trainer.method.local_loss"):
        trainer = make_trainer(top_k=10**6)
    assert trainer.objective.top_k == trainer.model.config.vocab_size
    assert "exceeds the vocabulary" in caplog.text and "PDU-like" in caplog.text


def test_top_k_share_of_the_vocabulary_is_resolved_and_logged(make_trainer, caplog):
    with caplog.at_level(logging.INFO, logger="palu_trainer.method.local_loss"):
        trainer = make_trainer(top_k=0.15625)
    assert trainer.model.config.vocab_size == 2048 and trainer.objective.top_k == 320
    assert "top_k=0.15625: K=320 of |V|=2048 (15.62% of the vocabulary)" in caplog.text
    assert "PDU-like" not in caplog.text


@pytest.mark.parametrize(
    ("method_args", "message"),
    [
        (
            {"top_k": 0},
            r"top_k=0: give a positive integer K, `all`, or a share of the vocabulary in \(0, 1\]",
        ),
        ({"top_k": -5}, r"top_k=-5: give a positive integer K"),
        ({"top_k": "abc"}, r"top_k='abc': give a positive integer K"),
        ({"top_k": 1.5}, r"top_k=1.5: give a positive integer K"),
        ({"kl_weight": -1}, r"kl_weight=-1: must be a number >= 0"),
        ({"kl_weight": "beta"}, r"kl_weight='beta': must be a number >= 0 .* or `alpha`"),
    ],
)
def test_bad_top_k_and_kl_weight_stop_before_training(make_trainer, method_args, message):
    """Issue #14 item 3: top_k=0 trained on NaN logged as 0.0, -5 failed at step 1, abc with a TypeError,
    kl_weight=-1 was accepted. The trainer stops the run in one line, naming where the option sits."""
    with pytest.raises(RunStopped, match="trainer.method_args." + message):
        make_trainer(**method_args)


@pytest.mark.parametrize(
    ("method_args", "message"),
    [
        ({"target": "median"}, "choose one of global_mean, topk_mean, ref_mean, uniform, zero"),
        ({"target_gradient": "yes"}, "target_gradient='yes'; choose one of true, false"),
        ({"kl_direction": "forward"}, "kl_direction='forward'; choose one of ref_to_policy, policy_to_ref"),
        (
            {"merge_adjacent_spans": True},
            "merge_adjacent_spans=True but the forget dataset's initiating policy",
        ),
        ({"retain_loss_type": "L2"}, "retain_loss_type='L2'"),
        ({"reference_cache_dtype": "int8"}, "choose one of"),
        ({"reference_cache": "yes"}, "reference_cache='yes'; choose one of auto, true, false"),
        ({"reference_cache_top_m": 0}, "reference_cache_top_m=0: must be an integer >= 1"),
        ({"local_loss_scale": "initial"}, "local_loss_scale='initial'; choose one of none, reference"),
        ({"log_term_gradient_norms": "yes"}, "log_term_gradient_norms='yes'; choose one of true, false"),
    ],
)
def test_bad_method_args_are_rejected(make_trainer, method_args, message):
    with pytest.raises((RunStopped, ValueError), match=message):  # the dataset's policy: a ValueError
        make_trainer(**method_args)


def test_n_belongs_to_the_forget_dataset(make_trainer):
    trainer = make_trainer(max_steps=1, num_initiating_tokens=2)
    assert trainer.train_dataset.forget.initiating_policy.num_tokens == 2
    with pytest.raises(
        RunStopped, match="belongs to the forget dataset.*top-level `num_initiating_tokens=N`"
    ):
        PALUTrainer(num_initiating_tokens=2)


def test_forget_batches_without_roles_are_rejected(make_trainer):
    ensure_importable()
    from data.collators import DataCollatorForSupervisedDataset

    with pytest.raises(RunStopped, match="PALU needs token roles in the forget batches"):
        make_trainer(collator=DataCollatorForSupervisedDataset)


@pytest.mark.parametrize("reference_cache", [True, False], ids=["cache", "reference-model"])
def test_reference_scaled_local_loss_starts_at_one(make_trainer, reference_cache):
    """local_loss_scale=reference: at the first step the policy is the reference, so every initiating
    position's loss equals the divisor; the paper's form logs the reference's own spread (far from 1)."""
    logged = {}
    for scale in ("none", "reference"):
        trainer = make_trainer(max_steps=1, top_k=64, reference_cache=reference_cache, local_loss_scale=scale)
        trainer.train()
        logged[scale] = next(e for e in trainer.state.log_history if "local_loss" in e)["local_loss"]
    assert logged["reference"] == pytest.approx(1.0, abs=1e-3)
    assert abs(logged["none"] - 1.0) > 0.1


def test_term_gradient_norms_are_logged_at_logging_steps_only(make_trainer, monkeypatch):
    """Each weighted term's gradient norm, computed only on the steps that log (1 and 2 of 3 with
    logging_steps=2 and logging_first_step). At step 1 the policy is the reference, so the KL's gradient
    is 0 and the step's whole gradient is the local and retain terms' (triangle inequality)."""
    from palu_trainer.framework.trainers import palu

    calls = []
    measure = palu.term_gradient_norms
    monkeypatch.setattr(palu, "term_gradient_norms", lambda *a: calls.append(1) or measure(*a))
    trainer = make_trainer(
        max_steps=3,
        top_k=64,
        log_term_gradient_norms=True,
        training_arguments={"logging_steps": 2, "logging_first_step": True},
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "grad_norm_local" in entry]
    assert [entry["step"] for entry in logged] == [1, 2] and len(calls) == 2
    first = logged[0]
    assert first["grad_norm_local"] > 0 and first["grad_norm_retain"] > 0
    assert first["grad_norm_kl"] == pytest.approx(0.0, abs=1e-4)
    assert abs(first["grad_norm_local"] - first["grad_norm_retain"]) - 1e-3 <= first["grad_norm"]
    assert first["grad_norm"] <= first["grad_norm_local"] + first["grad_norm_retain"] + 1e-3
    assert logged[1]["grad_norm_kl"] > 0  # the policy has moved


def test_building_the_reference_cache_leaves_the_random_stream_alone(make_trainer):
    """The cache is built before the first step: had it drawn from torch's global generator (a DataLoader
    draws its seed there), every later shuffle and dropout of the run would change with it."""
    trainer = make_trainer(top_k=64, reference_cache=True)
    before = torch.random.get_rng_state()
    cache = trainer._build_reference_cache(trainer.model)
    assert len(cache.initiating["topk_indices"]) == len(trainer.train_dataset.forget)
    assert torch.equal(torch.random.get_rng_state(), before)
