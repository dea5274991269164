"""GRPO end to end on the tiny addition task (reward rises, checkpoints resume), its
command line, and the pieces a pretrained-model run adds."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

import phalanx as px
from phalanx.algorithms.grpo import (
    GRPOConfig,
    cli,
    derive_max_total_sequence_length,
    group_normalized_advantages,
    train,
)
from phalanx.algorithms.grpo_group_calls import generate as _generate
from phalanx.algorithms.grpo_loss import OnPolicyPGLossFn, gen_logprob_error_sum
from phalanx.llm.loss import ClippedPGLossConfig, ClippedPGLossFn, token_logprobs
from tests.helpers import kill_generation_after_step_1


@pytest.mark.smoke
def test_group_normalized_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_normalized_advantages(r, 4)
    assert adv[0] > 0 and torch.all(adv[1:4] < 0)
    torch.testing.assert_close(adv[:4].sum(), torch.tensor(0.0), atol=1e-6, rtol=0)
    assert torch.all(adv[4:] == 0)  # a group with one reward carries no signal
    with pytest.raises(ValueError, match="groups of 3"):
        group_normalized_advantages(r, 3)


@pytest.mark.smoke
def test_clipped_pg_loss_values():
    # One sequence of 3 tokens, vocab 2; the last two tokens are trained on.
    logits = torch.zeros(1, 3, 2, requires_grad=True)
    data = {
        "input_ids": torch.tensor([[0, 1, 1]]),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0]]),
        "sample_mask": torch.tensor([1.0]),
        "advantages": torch.tensor([2.0]),
        "prev_logprobs": torch.log(torch.tensor([[1.0, 0.5, 0.5]])),
        "reference_policy_logprobs": torch.log(torch.tensor([[1.0, 0.25, 0.25]])),
    }
    fn = ClippedPGLossFn(ClippedPGLossConfig(0.2, 0.2, 0.5))
    loss, m = fn(logits, data, torch.tensor(1.0), torch.tensor(2.0))
    # ratio 1 everywhere: pg = -A per token; k3 with ref/pi = 0.5: 0.5 - ln 0.5 - 1.
    k3 = 0.5 - torch.log(torch.tensor(0.5)) - 1
    expected = (-2.0 * 2 + 0.5 * 2 * k3) / 2
    torch.testing.assert_close(loss, expected)
    assert m["num_valid_tokens"] == 2 and m["clip_frac_sum"] == 0
    loss.backward()
    assert logits.grad.abs().sum() > 0
    with pytest.raises(KeyError, match="advantages"):
        fn(
            logits,
            {k: v for k, v in data.items() if k != "advantages"},
            torch.tensor(1.0),
            torch.tensor(2.0),
        )


def test_on_policy_loss_is_the_clipped_loss_with_its_own_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    data = {
        "input_ids": torch.randint(0, 7, (2, 5)),
        "token_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32),
        "sample_mask": torch.ones(2),
        "advantages": torch.tensor([1.5, -0.5]),
    }
    cfg = ClippedPGLossConfig(0.2, 0.2, 0.0)
    loss, m = OnPolicyPGLossFn(cfg)(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    prev = torch.nn.functional.pad(token_logprobs(logits, data["input_ids"]).detach(), (1, 0))
    ref_logits = logits.detach().clone().requires_grad_(True)
    expected, m2 = ClippedPGLossFn(cfg)(
        ref_logits, {**data, "prev_logprobs": prev}, torch.tensor(2.0), torch.tensor(5.0)
    )
    torch.testing.assert_close(loss, expected)
    # ratio 1: the loss is -mean(A) over the valid tokens, nothing clipped
    torch.testing.assert_close(loss, torch.tensor(-(1.5 * 3 - 0.5 * 2) / 5))
    assert m["clip_frac_sum"] == 0 and m["ratio_sum"] == pytest.approx(5.0)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)
    assert "prev_logprobs" not in data  # the caller's batch is left as it was


@pytest.mark.smoke
def test_gen_logprob_error_is_the_token_mult_prob_error_less_one():
    # The probabilities differ by a factor 2 on two valid tokens and agree on the third;
    # the fourth is masked. NeMo-RL's token_mult_prob_error: (2 + 2 + 1) / 3.
    trainer = torch.log(torch.tensor([[0.5, 0.25, 0.1, 0.9]], dtype=torch.float64))
    generator = torch.log(torch.tensor([[0.25, 0.5, 0.1, 0.05]], dtype=torch.float64))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    total = gen_logprob_error_sum(trainer, generator, mask)
    assert float(total) == pytest.approx(2.0, abs=1e-12)
    assert float(total) / 3 == pytest.approx(5 / 3 - 1, abs=1e-12)
    assert float(gen_logprob_error_sum(trainer, trainer, mask)) == 0.0

    # In the loss: against the forward's own log-probs (one update per batch), or against
    # policy_logprobs when the batch carries its "old" log-probs.
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    own = torch.nn.functional.pad(token_logprobs(logits, ids), (1, 0))
    data = {
        "input_ids": ids,
        "token_mask": torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float32),
        "sample_mask": torch.ones(2),
        "advantages": torch.tensor([1.0, -1.0]),
        "generation_logprobs": own + torch.log(torch.tensor([[1.0], [1.5]])),
        "generation_is_current": torch.ones(2),
    }
    fn = OnPolicyPGLossFn(ClippedPGLossConfig(0.2, 0.2, 0.0))
    _, m = fn(logits, data, torch.tensor(2.0), torch.tensor(5.0))
    assert m["gen_logprob_error_sum"] == pytest.approx(2 * 0.5, abs=1e-5)  # row 1: 2 tokens
    old = {**data, "prev_logprobs": own, "policy_logprobs": data["generation_logprobs"]}
    _, m_old = fn(logits, old, torch.tensor(2.0), torch.tensor(5.0))
    assert m_old["gen_logprob_error_sum"] == 0.0
    _, m_none = fn(
        logits, {k: data[k] for k in list(data)[:4]}, torch.tensor(2.0), torch.tensor(5.0)
    )
    assert "gen_logprob_error_sum" not in m_none


def test_derive_max_total_sequence_length():
    assert derive_max_total_sequence_length(40, 192) == 240  # 232 rounded up to 16
    assert derive_max_total_sequence_length(33, 64) == 112
    assert derive_max_total_sequence_length(5, 4, model_max_positions=64) == 16
    assert derive_max_total_sequence_length(50, 10, model_max_positions=64) == 64  # capped
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 64"):
        derive_max_total_sequence_length(60, 10, model_max_positions=64)
    with pytest.raises(ValueError, match="must be positive"):
        derive_max_total_sequence_length(0, 10)


@pytest.mark.smoke
def test_config_errors_name_the_value(tmp_path):
    with pytest.raises(ValueError, match="samples_per_prompt"):
        GRPOConfig(samples_per_prompt=1).validate()
    with pytest.raises(ValueError, match="num_policy_workers 2"):
        GRPOConfig.tiny(prompts_per_step=3, samples_per_prompt=3).validate()
    with pytest.raises(ValueError, match="nope"):
        GRPOConfig(model=str(tmp_path / "nope")).validate()
    with pytest.raises(ValueError, match="train_global_batch_size 48 does not divide"):
        GRPOConfig(train_global_batch_size=48).validate()
    with pytest.raises(ValueError, match="time_limit_s"):
        GRPOConfig(time_limit_s=0).validate()
    with pytest.raises(ValueError, match="top_p"):
        GRPOConfig(top_p=1.5).validate()
    # Pretrained defaults: the configuration bench_grpo_real.py measures.
    d = GRPOConfig()
    assert (d.warmup_steps, d.lr, d.max_new_tokens, d.kl_beta) == (0, 2e-5, 64, 0.0)
    assert (d.prompts_per_step, d.samples_per_prompt, d.eval_size, d.eval_every) == (8, 8, 100, 5)
    assert d.max_total_sequence_length is None  # derived from the task's prompts


def test_cli_rejects_bad_input_before_starting_anything(tmp_path, capsys):
    assert cli(["--help"]) == 0
    assert "--max-new-tokens" in capsys.readouterr().out
    assert cli(["--no-such-flag"]) == 2  # a usage error
    assert cli(["--samples-per-prompt", "1", "--run-dir", str(tmp_path)]) == 1
    assert "samples_per_prompt must be >= 2" in capsys.readouterr().err
    assert cli(["--resume", "--run-dir", str(tmp_path / "none")]) == 1
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.slow(reason="40 GRPO steps: the rise of the reward needs them (gains 0.10-0.18)")
@pytest.mark.timeout(600)
def test_grpo_raises_reward_and_resumes(cluster, tmp_path):
    run_dir = str(tmp_path / "run")
    cfg = GRPOConfig.tiny(run_dir=run_dir, steps=40, checkpoint_every=20, progress=False)
    result = train(cfg, cluster)
    hist = result["history"]
    assert [h["step"] for h in hist] == list(range(1, 41))
    # The noise-free measure: probability of the exact answer on all 100 prompts, from
    # log-probs, before GRPO (right after the warm-up) and after 40 steps. Sampling noise
    # cannot move it; measured gains are 0.10-0.18 (seeds 0-3).
    evals = dict(result["p_correct"])
    assert sorted(evals) == [0, 10, 20, 30, 40]
    assert evals[40] > evals[0] + 0.07, evals
    # The sampled reward (32 prompts x 8 samples a step) rises with it.
    rewards = [h["reward_mean"] for h in hist]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.02, rewards
    for key in ("kl", "entropy", "response_length", "time/generation", "time/refit"):
        assert key in hist[0]
    assert hist[-1]["kl"] < 1.0  # the KL penalty keeps the policy near the reference
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(x) for x in f]
    assert sum("reward_mean" in x for x in lines) == 40
    assert sum("p_correct" in x for x in lines) == 5
    # Greedy accuracy on the held-out split (all 100 prompts) at the same steps.
    accs = {x["step"]: x["eval/accuracy"] for x in lines if "eval/accuracy" in x}
    assert sorted(accs) == [0, 10, 20, 30, 40] and all(0 <= a <= 1 for a in accs.values())
    assert dict(result["eval_accuracy"]) == accs
    assert os.path.exists(os.path.join(run_dir, "curve.png"))
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_40", "state.json"))

    # Resume from step 40 for two more steps.
    # on_training runs after each step's training, with the policy whose workers trained.
    cfg2 = GRPOConfig(**{**cfg.__dict__, "steps": 42, "resume": True})
    seen = []

    def on_training(step, policy):
        calls = [(0, (), {})]
        seen.append((step, policy.worker_group.apply(_optimizer_steps, calls).wait(60)[0]))

    result2 = train(cfg2, cluster, on_training=on_training)
    hist2 = result2["history"]
    assert [h["step"] for h in hist2] == [41, 42]
    assert [s for s, _ in seen] == [41, 42] and seen[1][1] == seen[0][1] + 1
    # The resumed policy is the trained one: same p_correct as where the first run ended.
    assert abs(dict(result2["p_correct"])[40] - evals[40]) < 1e-4
    # The resumed policy starts where the first run ended: its KL to the reference is
    # that of a trained policy, not of a fresh one.
    assert hist2[0]["kl"] > 0


def _optimizer_steps(worker):
    return max(int(st["step"]) for st in worker.optimizer.state.values())


def _exit_after(worker, delay_s):
    time.sleep(delay_s)
    os._exit(1)


@pytest.mark.timeout(120)
def test_generate_retries_once_after_a_worker_died(cluster, model_path, tokenizer):
    """The worker dies under the generate call (WorkerDiedError): the call is made
    again once the group restarted it."""
    from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts
    from phalanx.llm.generation import HFGenerationWorker

    cfg = {"model_name": model_path, "max_new_tokens": 4, "seed": 0}
    gen = HFGenerationWorker.create_group(cfg, tokenizer).launch(
        cluster,
        px.NodePlacement(num_workers=2),
        name="grpo_gen_retry",
        restart_policy=px.RestartPolicy(),
    )
    try:
        ids, lengths = encode_prompts(tokenizer, [p for p, _ in AdditionTask(0).sample_prompts(6)])
        data = px.BatchedDataDict(input_ids=ids, input_lengths=lengths)
        # Rank 1 exits while busy; the generate call queued behind it fails with the death.
        gen.apply(_exit_after, [(1, (0.5,), {})], label="exit")
        out = _generate(gen, data, timeout=60)
        assert gen.num_remote_worker_restarts() == 1
        assert out["output_ids"].shape == (6, ids.shape[1] + 4)
        for i in range(6):  # every row: its own prompt, then at least one new token
            n = int(lengths[i])
            assert torch.equal(out["output_ids"][i, :n], ids[i, :n])
            assert int(out["generation_lengths"][i]) >= 1
    finally:
        gen.shutdown()


_CLI_RUN_COST = "a GRPO run through the CLI (its workers start, one is killed), then its resume"


@pytest.fixture(scope="module")
def cli_run(cluster, tmp_path_factory) -> dict:
    """``phalanx train grpo --model tiny ...`` for two steps with one policy worker, its
    generation worker killed after step 1: one run shared by the CLI test and the
    killed-generation-worker test. Its rows are read before any test resumes it."""
    run_dir = str(tmp_path_factory.mktemp("grpo_cli") / "run")
    argv = [
        "--model", "tiny",
        "--run-dir", run_dir,
        "--steps", "2",
        "--prompts-per-step", "2",
        "--samples-per-prompt", "2",
        "--train-micro-batch-size", "2",
        "--num-policy-workers", "1",
        "--warmup-steps", "0",
        "--eval-every", "1",
        "--eval-size", "10",
        "--checkpoint-every", "2",
        "--no-progress",
    ]  # fmt: skip
    killed: list[float] = []
    killer = kill_generation_after_step_1(run_dir, killed)
    code = cli(argv)
    killer.join(5)
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    return {"run_dir": run_dir, "argv": argv, "code": code, "rows": rows, "killed": killed}


@pytest.mark.slow(reason=_CLI_RUN_COST)
@pytest.mark.timeout(400)
def test_grpo_survives_a_generation_worker_killed_between_steps(cli_run):
    assert cli_run["code"] == 0
    assert cli_run["killed"], "the generation worker was not killed"
    hist = [r for r in cli_run["rows"] if "reward_mean" in r]
    assert [h["step"] for h in hist] == [1, 2]
    assert hist[0]["generation_restarts"] == 0
    assert hist[1]["generation_restarts"] == 1  # restarted, refitted, and step 2 ran
    assert all(h["response_length"] > 0 for h in hist)
    recoveries = [r for r in cli_run["rows"] if "recovery/group" in r]
    assert [(r["recovery/group"], r["step"]) for r in recoveries] == [("generation", 2)]
    assert recoveries[0]["recovery/seconds"] >= recoveries[0]["recovery/start_seconds"] > 0


@pytest.mark.slow(reason=_CLI_RUN_COST)
@pytest.mark.timeout(400)
def test_two_steps_through_the_cli_then_resume(cli_run):
    """``phalanx train grpo --model tiny ...``: flags from the config dataclass, held-out
    accuracy in metrics.jsonl, a checkpoint, and --resume taking its config from it."""
    run_dir, argv, rows = cli_run["run_dir"], cli_run["argv"], cli_run["rows"]
    assert cli_run["code"] == 0
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    step2 = [r for r in rows if r["step"] == 2 and "reward_mean" in r][0]  # not a recovery row
    for key in ("time/generation", "time/training", "memory/generation_peak_gb",
                "memory/training_peak_gb", "truncated", "groups_with_signal"):  # fmt: skip
        assert key in step2, key
    assert step2["memory/training_peak_gb"] > 0.05  # a real process high-water mark
    # The generator (phalanx's own loop, fp32) and the trainer agree on the sampled tokens.
    for r in rows:
        if "reward_mean" in r:
            assert 0.0 <= r["train/gen_logprob_error"] < 1e-5, r["train/gen_logprob_error"]
    with open(os.path.join(run_dir, "config.json")) as f:
        saved = json.load(f)
    assert saved["model"] == "tiny" and saved["task"] == "tiny-addition"
    assert saved["max_total_sequence_length"] == 16  # "<s>9+9=" (5) + 4 new, rounded to 16
    assert os.path.exists(os.path.join(run_dir, "checkpoints", "step_2", "state.json"))

    # Resume one more step: the flags not given come from the checkpoint's config.
    assert cli(["--resume", "--run-dir", run_dir, "--steps", "3", "--no-progress"]) == 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    assert [r["step"] for r in rows if "reward_mean" in r] == [1, 2, 3]
    # A fresh run into a folder with checkpoints is refused, naming --resume.
    assert cli(argv) == 1
