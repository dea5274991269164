"""HF generation workers and refit from a 2-rank FSDP2 policy through every transport."""

from __future__ import annotations

import os
import time

import pytest
import torch

import phalanx as px
from phalanx.algorithms.grpo_tiny_task import AdditionTask, encode_prompts, sft_batch
from phalanx.llm.generation import GenerationWorker, HFGenerationWorker
from phalanx.llm.loss import NLLLoss
from phalanx.llm.policy import Policy
from phalanx.llm.refit import TRANSPORTS, Refitter
from phalanx.resources.cluster import find_free_port
from tests.helpers import until

pytestmark = pytest.mark.timeout(300)


def _gen_cfg(path, **over):
    cfg = {"model_name": path, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 1}
    cfg.update(over)
    return cfg


@pytest.fixture(scope="module")
def setup(cluster, model_path, tokenizer):
    cfg = {
        "model_name": model_path,
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "max_total_sequence_length": 32,
        "optimizer": {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}},
    }
    policy = Policy(cluster, cfg, tokenizer, num_workers=2, name_prefix="gen_pol")
    gen = HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
        cluster, px.NodePlacement(num_workers=2), name="gen_workers"
    )
    yield policy, gen
    gen.shutdown()
    policy.shutdown()


def _prompts(tokenizer, n=6, seed=0):
    pairs = AdditionTask(seed).sample_prompts(n)
    ids, lengths = encode_prompts(tokenizer, [p for p, _ in pairs])
    return px.BatchedDataDict(input_ids=ids, input_lengths=lengths)


def _local_greedy(model_path, state, tokenizer, data, max_new):
    """Greedy decoding with plain HF generate on a model holding ``state``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.load_state_dict(state)
    worker = HFGenerationWorker.__new__(HFGenerationWorker)
    worker.__init__(_gen_cfg(model_path, max_new_tokens=max_new), tokenizer)
    worker.model = model.eval()
    return worker.generate(data, greedy=True)


def test_generate_outputs_are_well_formed(setup, tokenizer):
    _, gen = setup
    data = _prompts(tokenizer)
    out = gen.execute_on(0).generate(data).wait(60)[0]
    B, P = data["input_ids"].shape
    assert out["output_ids"].shape == (B, P + 6)
    eos = tokenizer.eos_token_id
    for i in range(B):
        n, g = int(data["input_lengths"][i]), int(out["generation_lengths"][i])
        assert 1 <= g <= 6
        assert torch.equal(out["output_ids"][i, :n], data["input_ids"][i, :n])
        assert int(out["unpadded_sequence_lengths"][i]) == n + g
        gen_tokens = out["output_ids"][i, n : n + g]
        # Generation stops at the first stop token, which is kept.
        assert eos not in gen_tokens[:-1].tolist()
        assert g == 6 or gen_tokens[-1] == eos
        assert torch.all(out["logprobs"][i, n : n + g] <= 0)
        assert torch.all(out["logprobs"][i, :n] == 0) and torch.all(
            out["logprobs"][i, n + g :] == 0
        )
        assert torch.all(out["output_ids"][i, n + g :] == tokenizer.pad_token_id)
    # Greedy is deterministic; sampling at a high temperature varies.
    g1 = gen.execute_on(0).generate(data, greedy=True).wait(60)[0]
    g2 = gen.execute_on(1).generate(data, greedy=True).wait(60)[0]
    assert torch.equal(g1["output_ids"], g2["output_ids"])


def test_generation_config_errors(model_path, tokenizer):
    for bad, match in (
        ({"temperature": 0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"model_name": "/tmp/nope-model"}, "/tmp/nope-model"),
    ):
        with pytest.raises(ValueError, match=match):
            HFGenerationWorker(_gen_cfg(model_path, **bad), tokenizer)
    worker = HFGenerationWorker(_gen_cfg(model_path, max_new_tokens=60), tokenizer)
    with pytest.raises(ValueError, match="max_position_embeddings 64"):
        worker.generate(_prompts(tokenizer))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_refit_makes_generator_match_policy(setup, model_path, tokenizer, transport):
    policy, gen = setup
    # Move the policy away from what the generators hold: a training step plus noise.
    policy.train(sft_batch(tokenizer, AdditionTask(7).sample_prompts(8)), NLLLoss())
    seed = TRANSPORTS.index(transport) + 1
    g = policy.worker_group
    g.apply(_noise, [(r, (0.05, seed), {}) for r in (0, 1)], label="noise").wait(timeout=60)
    state = policy.state_dict()
    before = gen.execute_on(0).get_state_dict().wait(60)[0]
    assert any(not torch.equal(before[k], state[k]) for k in state)

    Refitter(policy, gen, transport).refit()

    data = _prompts(tokenizer, n=8, seed=seed)
    expected = _local_greedy(model_path, state, tokenizer, data, max_new=6)
    for rank, sd in enumerate(gen.get_state_dict().wait(60)):
        for k in state:
            assert torch.equal(sd[k], state[k]), (transport, rank, k)
    for out in gen.generate(data, greedy=True).wait(60):
        assert torch.equal(out["output_ids"], expected["output_ids"]), transport
        torch.testing.assert_close(out["logprobs"], expected["logprobs"])


def _noise(worker, std, seed):
    worker._add_noise_to_weights(std, seed)


@pytest.fixture(scope="module")
def restartable_gen(cluster, model_path, tokenizer):
    """Two generators with a restart policy, shared by the tests that kill one of them (the
    transports' restart tests kill rank 0 once each, the collective refit's test rank 1): a
    group per test would cost two process starts each."""
    gen = HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
        cluster,
        px.NodePlacement(num_workers=2),
        name="gen_ft",
        restart_policy=px.RestartPolicy(),
    )
    yield gen
    gen.shutdown()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_dead_generator_is_restarted_and_refitted_before_generating(
    setup, restartable_gen, model_path, tokenizer, transport
):
    import ray

    policy, _ = setup
    gen = restartable_gen
    restarts = gen.num_remote_worker_restarts()
    refitter = Refitter(policy, gen, transport)
    try:
        seed = 11 + TRANSPORTS.index(transport)
        g = policy.worker_group
        g.apply(_noise, [(r, (0.05, seed), {}) for r in (0, 1)], label="noise").wait(timeout=60)
        refitter.refit()
        data = _prompts(tokenizer, n=6, seed=seed)
        expected = _local_greedy(model_path, policy.state_dict(), tokenizer, data, max_new=6)

        ray.kill(gen.actors[0], no_restart=True)
        # the group's monitor sees the death within milliseconds
        assert until(lambda: gen.health()[0] != px.WorkerHealth.HEALTHY, timeout=30)
        # The next call waits for the restart, which refits rank 0 before it is called.
        outs = gen.generate(data, greedy=True).wait(120)
        assert gen.num_remote_worker_restarts() == restarts + 1
        for out in outs:
            assert torch.equal(out["output_ids"], expected["output_ids"]), transport
        assert gen.execute_on(0).is_alive().wait(30) == [True]

        # Later refits reach the restarted worker too (collective: the group is rebuilt).
        g.apply(_noise, [(r, (0.05, seed + 50), {}) for r in (0, 1)], label="noise").wait(
            timeout=60
        )
        refitter.refit()
        expected = _local_greedy(model_path, policy.state_dict(), tokenizer, data, max_new=6)
        for out in gen.generate(data, greedy=True).wait(60):
            assert torch.equal(out["output_ids"], expected["output_ids"]), transport
    finally:
        refitter.close()  # its restart hooks go: the next transport's restores rank 0


@pytest.mark.timeout(180)
def test_a_restarted_generator_samples_with_the_random_numbers_of_the_dead_one(
    cluster, model_path, tokenizer
):
    """GRPO's generate keeps each rank's sampler state after a sampled batch; a rank killed
    and restarted samples the next batch exactly as an undisturbed twin does."""
    import ray

    from phalanx.algorithms.grpo_group_calls import generate

    twins = [
        HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
            cluster,
            px.NodePlacement(num_workers=1),
            name=f"gen_rng_{name}",
            restart_policy=px.RestartPolicy(),
        )  # fmt: skip
        for name in ("killed", "undisturbed")
    ]
    try:
        first, second = _prompts(tokenizer, n=6, seed=31), _prompts(tokenizer, n=6, seed=32)
        outs = [generate(g, first, timeout=60) for g in twins]
        assert torch.equal(outs[0]["output_ids"], outs[1]["output_ids"])
        killed, undisturbed = twins
        ray.kill(killed.actors[0], no_restart=True)
        # the group's monitor sees the death within milliseconds
        assert until(lambda: killed.health()[0] != px.WorkerHealth.HEALTHY, timeout=30)
        again = generate(killed, second, timeout=120)
        assert killed.num_remote_worker_restarts() == 1
        expected = generate(undisturbed, second, timeout=60)
        assert torch.equal(again["output_ids"], expected["output_ids"])
        assert torch.equal(again["generation_lengths"], expected["generation_lengths"])
        # Each batch draws new random numbers: the equality above needs the kept state.
        fresh = generate(undisturbed, first, timeout=60)
        assert not torch.equal(fresh["output_ids"], outs[0]["output_ids"])
        with pytest.raises(px.WorkerError, match=r"ValueError: state: expected .*\['rng'\]"):
            undisturbed.execute_on(0).set_state({"rng": 1}).wait(30)
    finally:
        for g in twins:
            g.shutdown()


def _exit_after(worker, delay_s, started):
    """Mark ``started`` (a file), stay busy ``delay_s``, then exit the worker's process."""
    open(started, "w").close()
    time.sleep(delay_s)
    os._exit(1)


@pytest.mark.timeout(120)
def test_generator_dying_mid_collective_refit_is_named_and_next_refit_works(
    setup, restartable_gen, model_path, tokenizer, tmp_path
):
    policy, _ = setup
    gen = restartable_gen
    restarts = gen.num_remote_worker_restarts()
    refitter = Refitter(policy, gen, "collective", peer_timeout_s=20)
    try:
        refitter.refit()  # the refit group exists before the death
        g = policy.worker_group
        g.apply(_noise, [(r, (0.05, 21), {}) for r in (0, 1)], label="noise").wait(timeout=60)
        # Rank 1 is busy when the refit starts and exits mid-way: the policy's rank 0 is
        # already in the broadcast, rank 0 of the generators is receiving.
        started = tmp_path / "exit_call_started"
        gen.apply(_exit_after, [(1, (1.0, str(started)), {})], label="exit")
        assert until(started.exists, timeout=30)
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"gen_ft\[rank 1\]: worker died"):
            refitter.refit()
        assert time.perf_counter() - t0 < 20
        # The next refit waits for the restart, rebuilds the group and reaches everyone.
        refitter.refit()
        assert gen.num_remote_worker_restarts() == restarts + 1
        data = _prompts(tokenizer, n=6, seed=21)
        expected = _local_greedy(model_path, policy.state_dict(), tokenizer, data, max_new=6)
        for out in gen.generate(data, greedy=True).wait(60):
            assert torch.equal(out["output_ids"], expected["output_ids"])
    finally:
        refitter.close()


@pytest.mark.timeout(60)
def test_collective_refit_waits_at_most_peer_timeout_for_a_busy_generator(
    setup, model_path, tokenizer
):
    """A live generator that does not join the broadcast frees the others within
    ``peer_timeout_s`` (gloo's default would hold them 300 s); the next refit works."""
    policy, gen = setup
    with pytest.raises(ValueError, match="peer_timeout_s"):
        Refitter(policy, gen, "collective", peer_timeout_s=0)
    refitter = Refitter(policy, gen, "collective", peer_timeout_s=2)
    refitter.refit()
    busy = gen.apply(_sleep, [(1, (6.0,), {})], label="sleep")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="no member died"):
        refitter.refit()
    assert time.perf_counter() - t0 < 5  # before the busy rank could have joined
    busy.wait(30)
    refitter.refit()
    state = policy.state_dict()
    for sd in gen.get_state_dict().wait(60):
        assert all(torch.equal(sd[k], state[k]) for k in state)


def _sleep(worker, seconds):
    time.sleep(seconds)


def _refit_state(worker):
    return worker.weights_updates, worker.model_update_group is not None


@pytest.mark.timeout(120)
def test_nemo_rl_collective_refit_methods_load_the_policy_weights(
    cluster, setup, model_path, tokenizer
):
    """NeMo-RL's collective refit called by hand: policy rank 0 and the generators (at
    ``rank_offset`` 1) join one process group, the policy broadcasts and each generator
    copies the weights in, counting one update; before joining it refuses, naming why."""
    policy, _ = setup
    pg = policy.worker_group
    gen = HFGenerationWorker.create_group(_gen_cfg(model_path), tokenizer).launch(
        cluster, px.NodePlacement(num_workers=2), name="gen_nemo_collective"
    )
    try:
        assert gen.apply(_refit_state, [(0, (), {}), (1, (), {})]).wait(30) == [(0, False)] * 2
        with pytest.raises(
            px.WorkerError,
            match="RuntimeError: update_weights_from_collective: call init_collective first",
        ):
            gen.execute_on(0).update_weights_from_collective({}).wait(30)
        pg.apply(_noise, [(r, (0.05, 31), {}) for r in (0, 1)], label="noise").wait(timeout=60)
        meta = pg.worker_metadata[0]
        ip = meta["node_ip"]
        port = find_free_port(ip, meta["ray_node_id"])
        joined = [pg.call("init_collective", ip, port, 3), gen.init_collective(ip, port, 3)]
        assert [h.wait(60) for h in joined] == [[None, None], [True, True]]
        info = pg.call("prepare_info_for_collective").wait(60)[0]
        received = gen.update_weights_from_collective(info)
        pg.call("broadcast_weights_for_collective").wait(60)
        assert received.wait(60) == [True, True]
        state = policy.state_dict()
        for sd in gen.get_state_dict().wait(60):
            assert all(torch.equal(sd[k], state[k]) for k in state)
        assert gen.apply(_refit_state, [(0, (), {}), (1, (), {})]).wait(30) == [(1, True)] * 2
    finally:
        gen.shutdown()


def test_refit_state_is_held_by_the_receiver():
    """The generation workers' refit state lives in the ``RefitReceiver`` they hold: no
    class here reads state that another class must set on it."""
    from phalanx.llm.refit_receiver import RefitReceiver
    from phalanx.llm.vllm_generation import VllmGenerationWorker
    from tests.group.test_held_state import foreign_reads

    for cls in (RefitReceiver, GenerationWorker, HFGenerationWorker, VllmGenerationWorker):
        assert foreign_reads(cls) == [], cls.__name__


def _local_worker(model_path, tokenizer, **over):
    worker = HFGenerationWorker.__new__(HFGenerationWorker)
    worker.__init__(_gen_cfg(model_path, num_threads=1, **over), tokenizer)
    return worker


def test_decoding_loop_matches_hf_generate_with_shared_prefills(model_path, tokenizer):
    """Repeated prompts share one prefill and rows leave the batch as they finish; greedy
    tokens and their log-probs are still those of HF generate, row by row, and no
    [B, new, V] logits come back."""
    from transformers import AutoModelForCausalLM

    worker = _local_worker(model_path, tokenizer, max_new_tokens=6)
    data = _prompts(tokenizer, n=4, seed=3).repeat_interleave(3)
    out = worker.generate(data, greedy=True)
    assert set(out.keys()) == {
        "output_ids",
        "logprobs",
        "generation_lengths",
        "unpadded_sequence_lengths",
    }
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for i in range(data.size):
        n = int(data["input_lengths"][i])
        ref = model.generate(
            input_ids=data["input_ids"][i : i + 1, :n],
            attention_mask=torch.ones(1, n, dtype=torch.long),
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
        new = ref.sequences[0, n:]
        g = int(out["generation_lengths"][i])
        assert g == len(new)
        assert out["output_ids"][i, n : n + g].tolist() == new.tolist()
        lp = torch.log_softmax(torch.stack(ref.logits)[:, 0].float(), -1)
        expected = lp.gather(-1, new[:, None]).squeeze(-1)
        torch.testing.assert_close(out["logprobs"][i, n : n + g], expected, atol=1e-5, rtol=0)


def test_sampling_is_per_row_and_top_p_narrows_it(model_path, tokenizer):
    data = _prompts(tokenizer, n=1, seed=5).repeat_interleave(8)
    hot = _local_worker(model_path, tokenizer, max_new_tokens=6, temperature=2.0)
    rows = {tuple(r) for r in hot.generate(data)["output_ids"].tolist()}
    assert len(rows) > 1  # one shared prefill, yet every row samples on its own
    again = _local_worker(model_path, tokenizer, max_new_tokens=6, temperature=2.0)
    assert torch.equal(
        again.generate(data)["output_ids"],
        _local_worker(model_path, tokenizer, max_new_tokens=6, temperature=2.0).generate(data)[
            "output_ids"
        ],
    )  # the same seed samples the same tokens
    # A nucleus this small keeps only the most likely token: sampling becomes greedy.
    narrow = _local_worker(model_path, tokenizer, max_new_tokens=6, top_p=1e-6)
    greedy = narrow.generate(data, greedy=True)["output_ids"]
    assert torch.equal(narrow.generate(data)["output_ids"], greedy)
