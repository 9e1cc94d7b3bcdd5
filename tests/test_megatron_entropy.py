"""vocab_parallel_entropy: the entropy of a vocabulary split over two TP ranks (gloo on the CPU), chunked or not,
equals the entropy of the whole vocabulary on one rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core not installed (scripts/setup-megatron-cpu.sh)")

from hybridrl.engines.server import free_port  # noqa: E402

VOCAB = 12


def _rank(rank: int, port: int, logits: torch.Tensor, out: str) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.trainers.megatron.policy import vocab_parallel_entropy

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    try:
        local = logits[..., rank * VOCAB // 2 : (rank + 1) * VOCAB // 2].clone().requires_grad_(True)
        # whole rows, one position, three positions a chunk: every split gives the same result
        got = [vocab_parallel_entropy(local, chunk_bytes=b) for b in (1 << 28, 4 * VOCAB // 2, 4 * VOCAB // 2 * 3)]
        unchanged = torch.equal(local.detach(), logits[..., rank * VOCAB // 2 : (rank + 1) * VOCAB // 2])
        if rank == 0:
            torch.save({"got": got, "unchanged": unchanged}, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_split_vocabulary_entropy_equals_the_whole_ones(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    torch.manual_seed(0)
    logits = torch.randn(2, 5, VOCAB) * 3
    logits[0, 0] = torch.tensor([40.0] + [0.0] * (VOCAB - 1))  # one token certain: entropy near 0
    logits[0, 1] = 0.0  # flat: log V
    out = tmp_path / "entropy.pt"
    mp.start_processes(_rank, args=(free_port(), logits, str(out)), nprocs=2, start_method="spawn", join=True)
    result = torch.load(out)
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert result["unchanged"]  # the loss reads the same logits after
    for got in result["got"]:
        assert got.shape == (2, 5) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert result["got"][0][0, 0] < 1e-6 and result["got"][0][0, 1] == pytest.approx(torch.log(torch.tensor(12.0)))
