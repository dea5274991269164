"""The policy's state kept in mapped files (in-place recovery): two FSDP2 ranks keep their
shards after a step, a rank built afresh (as a relaunch builds it) restores them exactly,
and redoing the next step from there gives the weights of the undisturbed run."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.timeout(180)


def _build(model_path: str, world: int, momentum: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if momentum:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    return model, opt, sched


def _step(model, opt, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 40, (2, 12), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def _locals(model, opt) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    def local(t):
        return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"p/{n}": local(p) for n, p in model.named_parameters()}
    for i, s in enumerate(opt.state.values()):
        for k, v in s.items():
            out[f"o/{i}/{k}"] = local(v)
    return out


def _ranks(rank: int, world: int, init_file: str, model_path: str, root: str) -> None:
    import torch.distributed as dist

    from phalanx.llm.kept_state import KeptState, StateLayoutError

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, opt, sched = _build(model_path, world)
        _step(model, opt, sched, seed=1)
        kept = KeptState(rank)
        nbytes = kept.keep(root, 0, model, opt, sched)
        data = os.path.join(root, f"rank{rank}-slot0.state")
        inode = os.stat(data).st_ino
        assert (
            kept.keep(root, 0, model, opt, sched) == nbytes and os.stat(data).st_ino == inode
        )  # reused
        want = _locals(model, opt)
        lr_after_1 = opt.param_groups[0]["lr"]
        _step(model, opt, sched, seed=2)  # the undisturbed run's step 2
        after_2 = _locals(model, opt)
        kept.keep(
            root, 1, model, opt, sched
        )  # the other slot: slot 0 still holds the state after step 1

        fresh_model, fresh_opt, fresh_sched = _build(model_path, world)  # a relaunched rank
        KeptState(rank).restore(root, 0, fresh_model, fresh_opt, fresh_sched)
        got = _locals(fresh_model, fresh_opt)
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert fresh_opt.param_groups[0]["lr"] == lr_after_1
        assert fresh_sched.last_epoch == 1
        _step(fresh_model, fresh_opt, fresh_sched, seed=2)  # step 2 redone
        redone = _locals(fresh_model, fresh_opt)
        for k in after_2:
            assert torch.equal(redone[k], after_2[k]), k

        other_model, other_opt, other_sched = _build(model_path, world, momentum=True)
        _step(other_model, other_opt, other_sched, seed=1)
        try:
            KeptState(rank).restore(root, 0, other_model, other_opt, other_sched)
        except StateLayoutError as e:
            assert f"rank {rank}:" in str(e) and "does not fit" in str(e), e
        else:
            raise AssertionError("an SGD optimizer took the state AdamW kept")
        try:
            KeptState(rank).restore(root + "-none", 0, other_model, other_opt, other_sched)
        except FileNotFoundError:
            pass
        else:
            raise AssertionError("restoring from an empty folder did not fail")
    finally:
        dist.destroy_process_group()


def test_two_ranks_keep_restore_and_redo_a_step_exactly(model_path, tmp_path):
    import torch.multiprocessing as mp

    root = tmp_path / "kept"
    root.mkdir()
    mp.spawn(
        _ranks, args=(2, str(tmp_path / "pg"), str(model_path), str(root)), nprocs=2, join=True
    )
    names = sorted(p.name for p in root.iterdir())
    assert names == [
        f"rank{r}-slot{s}.{ext}" for r in (0, 1) for s in (0, 1) for ext in ("meta", "state")
    ]


def test_a_slot_other_than_0_or_1_is_refused(tmp_path):
    from phalanx.llm.kept_state import KeptState

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="slot must be 0 or 1, got 2"):
        KeptState(rank=0).keep(str(tmp_path), 2, model, opt, None)
