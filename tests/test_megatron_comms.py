"""The Megatron ranks' process groups released at offload and made again at onload (release_comms): what points at
an old group is pointed at its successor, and a TP 2 update after a release lands where one without it does."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from hybridrl.trainers.megatron.comms import rebind  # noqa: E402


class _Group:
    """Stands in for a process group: rebind matches references by identity, whatever the object."""


@dataclasses.dataclass
class _Collection:  # as megatron's ProcessGroupCollection: groups as fields
    tp: Any
    dp: Any = None


class _Layer(torch.nn.Module):
    def __init__(self, group: Any, collection: _Collection) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.tp_group = group
        self.pg_collection = collection
        self.groups = [group, "other"]
        self.pair = (group, 1)


def test_rebind_points_every_reference_at_the_successor_and_leaves_the_rest() -> None:
    old, new, kept = _Group(), _Group(), _Group()
    inner = _Layer(old, _Collection(tp=old, dp=kept))
    model = torch.nn.Sequential(inner, _Layer(old, _Collection(tp=kept)))
    weight = inner.linear.weight
    holder = {"model": model, "by_name": {"tp": old}}
    changed = rebind([holder], {id(old): new})
    assert changed == 8  # per layer: tp_group, groups[0], pair; the first collection's tp; the dict entry
    for layer in model:
        assert layer.tp_group is new and layer.groups == [new, "other"] and layer.pair == (new, 1)
    assert inner.pg_collection.tp is new and inner.pg_collection.dp is kept
    assert model[1].pg_collection.tp is kept
    assert holder["by_name"]["tp"] is new
    assert inner.linear.weight is weight  # tensors are not walked or touched
    assert rebind([holder], {id(old): new}) == 0  # nothing left to change


def test_stale_layers_counts_modules_left_on_a_group_that_is_not_the_current_one() -> None:
    from hybridrl.trainers.megatron.comms import stale_layers

    # no groups exist in this process: the current tensor-parallel group is None
    model = torch.nn.Sequential(_Layer(_Group(), _Collection(tp=None)), _Layer(None, _Collection(tp=None)))
    assert stale_layers(model) == 1
    model[0].tp_group = None
    assert stale_layers(model) == 0
    # a MoE layer's expert-parallel group, on the layer or in the token dispatcher it holds (not a module)
    model[1].ep_group = _Group()
    assert stale_layers(model) == 1
    model[1].ep_group = None
    model[1].token_dispatcher = _Collection(tp=None)
    model[1].token_dispatcher.ep_group = _Group()
    assert stale_layers(model) == 1


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "tp", "ep"), [("qwen2", 2, 1), ("qwen3_moe", 1, 2)])
def test_update_after_releasing_and_remaking_the_groups_matches_one_without(tmp_path: Path, arch: str, tp: int,
                                                                             ep: int) -> None:
    """Two process groups of two ranks on gloo (TP 2, or the MoE at EP 2), the same batches: one releases its groups
    at every offload and makes them again at the next onload (or step). Steps 2 and 3 agree to float precision, and
    each step says how often its groups were made again (a trainer that keeps them says nothing)."""
    from hybridrl.tools import megatron_parity as parity
    from hybridrl.trainers.megatron import MegatronTrainer

    model = parity.tiny_checkpoint(arch, tmp_path / "model")
    batches = [parity.make_samples(128, n=8, seed=s) for s in (11, 12, 13)]
    results: dict[bool, list[Any]] = {}
    for release in (False, True):
        trainer = MegatronTrainer(model, parity.default_run(tp, ep, release_comms=release), tmp_path / f"run-{release}")
        steps = []
        try:
            for i, batch in enumerate(batches):
                if i:
                    trainer.offload()
                    if i == 1:  # step 2 after an onload, step 3 without one: the step makes the groups itself
                        trainer.onload()
                steps.append(trainer.step(i + 1, batch, tmp_path / f"adapters-{release}/step{i + 1}"))
            trainer.offload()  # released again: the group must still shut down cleanly
        finally:
            trainer.close()
        assert trainer.proc.poll() == 0, "the ranks did not exit cleanly"
        results[release] = steps
    assert [r.metrics["train/comms_remade"] for r in results[True]] == [0, 1, 2]
    assert all(math.isnan(r.metrics["train/comms_remade"]) for r in results[False])  # JSON null: no value
    for kept, remade in zip(results[False][1:], results[True][1:], strict=True):
        for k in ("train/loss", "train/grad_norm", "train/kl", "check/rollout_logprob_abs_diff", "train/lora_norm"):
            assert remade.metrics[k] == pytest.approx(kept.metrics[k], rel=1e-5, abs=1e-7), k
