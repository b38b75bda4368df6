"""perf/reference_tail.py's statistics against direct computations, and perf/bench.py's SmolLM2 preset."""

import importlib.util
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from palu_trainer.method.reference_cache import build_reference_cache
from palu_trainer.method.roles import TokenRole

from ..conftest import unavailable

PERF = Path(__file__).resolve().parents[2] / "perf"


def load(name):
    spec = importlib.util.spec_from_file_location(name, PERF / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tail():
    return load("reference_tail")


@pytest.fixture(scope="module")
def bench():
    return load("bench")


def peaked_logits(rows, vocab, seed):
    """Logits with a few large entries per row over a long tail, as a language model's."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64)
    logits[:, :20] += 6 * torch.rand(rows, 20, generator=generator, dtype=torch.float64)
    return logits[:, torch.randperm(vocab, generator=generator)]


def direct_tail(logits, m):
    probs = torch.softmax(logits.double(), -1).sort(-1, descending=True).values
    return probs[:, m:].sum(-1)


def test_tail_masses_are_the_mass_outside_the_top_m(tail):
    logits = peaked_logits(64, 1000, seed=0).float()
    masses = tail.tail_masses(logits, (1, 10, 100, 999, 1000, 4096))
    for m in (1, 10, 100, 999):
        torch.testing.assert_close(masses[m].double(), direct_tail(logits, m), rtol=1e-4, atol=1e-7)
    assert masses[1].min() > 0.05 and (masses[100] < masses[10]).all()
    assert masses[1000].abs().max() == 0 and masses[4096].abs().max() == 0  # m >= |V|: no tail


def test_distribution_reads_mean_quantiles_and_max(tail):
    summary = tail.distribution(torch.arange(101.0))
    assert summary == {"mean": 50.0, "median": 50.0, "p90": 90.0, "p99": 99.0, "max": 100.0}


def test_the_dropped_kl_is_the_tails_own_kl_and_the_gradient_error_is_within_2r(tail):
    reference = peaked_logits(32, 700, seed=1)
    policy = reference + 0.5 * torch.randn(reference.shape, generator=torch.Generator().manual_seed(2))
    m = 50
    result = tail.kl_full_and_top_m(policy, reference, m)
    p, q = torch.softmax(reference, -1), torch.softmax(policy, -1)
    full = (p * (p.log() - q.log())).sum(-1)
    torch.testing.assert_close(result["full"], full)
    top = p.topk(m, -1).indices
    in_top = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, top, True)
    r, tail_q = (p * ~in_top).sum(-1), (q * ~in_top).sum(-1)
    coarse = (p * (p.log() - q.log()) * in_top).sum(-1) + r * (r.log() - tail_q.log())
    torch.testing.assert_close(result["top_m"], coarse)
    torch.testing.assert_close(result["tail_mass"], r)
    # what the coarsening drops: r times the KL between the two tails, each normalised
    tails = (p / r[:, None] * ((p / r[:, None]).log() - (q / tail_q[:, None]).log()) * ~in_top).sum(-1)
    torch.testing.assert_close(result["full"] - result["top_m"], r * tails)
    assert (result["full"] - result["top_m"] > 0).all()
    # gradients: q - p exactly, q_j (1 - r/Q) on the coarsened tail
    coarse_gradient = torch.where(in_top, q - p, q * (1 - r / tail_q)[:, None])
    torch.testing.assert_close(result["gradient_l1_error"], (coarse_gradient - (q - p)).abs().sum(-1))
    torch.testing.assert_close(result["gradient_l1"], (q - p).abs().sum(-1))
    assert (result["gradient_l1_error"] <= 2 * r).all()
    summary = tail.kl_summary([result])
    assert summary["dropped"] == pytest.approx(float((full - coarse).mean()))
    assert summary["dropped_share"] == pytest.approx(float((full - coarse).mean() / full.mean()))
    assert summary["two_r_bound_held"]
    every = tail.kl_full_and_top_m(policy, reference, 700)  # m = |V|: the exact KL
    torch.testing.assert_close(every["top_m"], every["full"])


def test_the_reference_pass_reads_the_common_positions_of_a_tiny_llama(tail):
    vocab = 300
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            tie_word_embeddings=True,
        )
    ).eval()
    with torch.no_grad():  # peaked outputs, so that tails differ between m
        model.lm_head.weight.mul_(10)
    generator = torch.Generator().manual_seed(3)
    roles = torch.full((3, 14), int(TokenRole.IGNORED))
    roles[:, 4:12] = TokenRole.COMMON
    roles[:, 6] = TokenRole.INITIATING
    roles[:, 7] = TokenRole.REDUNDANT
    roles[2, 10:] = TokenRole.IGNORED  # a shorter row: padding
    batches = [
        {
            "input_ids": torch.randint(3, vocab, (3, 14), generator=generator),
            "attention_mask": (roles != TokenRole.IGNORED) | (torch.arange(14) < 4),
            "token_roles": roles,
            "index": torch.arange(3) + 3 * batch,
        }
        for batch in range(2)
    ]
    top_ms = (4, 16, vocab)
    reference = tail.ReferencePass(
        lambda inputs: model(**inputs, output_hidden_states=True).hidden_states[-1],
        model.lm_head,
        top_k=5,
        top_m=16,
        top_ms=top_ms,
        noise_sigmas=(0.3,),
        kl_top_ms=(16, vocab),
    )
    cache = build_reference_cache(reference.batch_targets, batches)
    common = []
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            common.append(logits[:, :-1][batch["token_roles"][:, 1:] == TokenRole.COMMON])  # t-1 predicts t
    common = torch.cat(common)
    assert reference.counts == {"initiating": 6, "common": len(common)} and len(common) == 2 * (3 * 6 - 2)
    for m in top_ms:
        torch.testing.assert_close(
            torch.cat(reference.tails[m]).double(), direct_tail(common, m), atol=1e-6, rtol=1e-4
        )
    tails = reference.tail_table()
    assert tails[4]["mean"] > tails[16]["mean"] > 0.01 and tails[vocab]["max"] == 0
    torch.testing.assert_close(torch.cat(list(cache.common["tail"].values())), torch.cat(reference.tails[16]))
    torch.testing.assert_close(
        torch.cat(reference.common_hidden) @ model.lm_head.weight.T, common, atol=1e-4, rtol=1e-5
    )
    noise = tail.kl_summary(reference.noise[0.3, 16])
    assert noise["positions"] == len(common) and noise["full_kl"] > noise["top_m_kl"] > 0
    exact = tail.kl_summary(reference.noise[0.3, vocab])  # m = |V|: nothing dropped
    assert exact["full_kl"] == pytest.approx(noise["full_kl"]) and abs(exact["dropped"]) < 1e-12
    # the policy pass: the reference itself gives 0, a changed output layer the direct KL
    step0 = model.lm_head.weight.detach().clone()

    def policy(project):
        parts = tail.policy_kls(
            lambda inputs: model(**inputs, output_hidden_states=True).hidden_states[-1],
            project,
            lambda hidden: hidden @ step0.T,
            batches,
            reference.common_hidden,
            cache,
            16,
            (4, 16),
        )
        assert "logged_fp32" in parts[16][0] and "logged_fp32" not in parts[4][0]  # the cache's m only
        return tail.kl_summary(parts[16])

    unchanged = policy(model.lm_head)
    assert abs(unchanged["full_kl"]) < 1e-10 and abs(unchanged["top_m_kl"]) < 1e-10
    moved_weight = step0 + 0.5 * torch.randn(step0.shape, generator=generator)
    moved = policy(lambda hidden: hidden @ moved_weight.T)
    p = torch.softmax(common.double(), -1)
    q = torch.softmax((torch.cat(reference.common_hidden) @ moved_weight.T).double(), -1)
    assert moved["full_kl"] == pytest.approx(float((p * (p.log() - q.log())).sum(-1).mean()), rel=1e-5)
    assert moved["top_m_kl_fp32_cache"] == pytest.approx(moved["top_m_kl"], rel=1e-3)
    assert moved["full_kl"] > moved["top_m_kl"] > 0


def test_the_smollm2_preset_without_the_converted_folder_says_make_smollm2(
    bench, tail, monkeypatch, tmp_path
):
    missing = tmp_path / "no-smollm2"
    monkeypatch.setenv("SMOLLM2_DIR", str(missing))
    out = tmp_path / "out.json"
    for main, argv in ((bench.main, ["--preset", "smollm2"]), (tail.main, [])):
        with pytest.raises(SystemExit, match=rf"not converted at {missing}.*run `make smollm2`"):
            main([*argv, "--out", str(out)])
    assert not out.exists()
    assert bench.with_model_dir(bench.PRESETS["small"]) == bench.PRESETS["small"]  # random init: no folder


def test_the_smollm2_preset_loads_the_real_tied_weights(bench):
    from palu_lab.smollm2 import default_dir, read_marker

    if read_marker(default_dir()) is None:
        unavailable(f"SmolLM2-135M-Instruct is not converted at {default_dir()}: run `make smollm2`")
    config = bench.with_model_dir(bench.PRESETS["smollm2"])
    model = bench.build_model(config, "cpu")
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    with safe_open(Path(config["model_dir"]) / "model.safetensors", "pt") as weights:
        saved = weights.get_tensor("model.embed_tokens.weight")
    assert torch.equal(model.get_input_embeddings().weight.detach(), saved)  # not a random init
    with pytest.raises(RuntimeError, match="not the preset's model"):
        bench.build_model({**config, "layers": 16}, "cpu")
