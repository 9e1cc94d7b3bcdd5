import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


@pytest.fixture(scope="module")
def groups() -> Iterator[Any]:
    """megatron's TP = 1 state in a one-process gloo group, as the TP 1 trainer has, so that its modules can be
    built in the test's process; yields the ProcessGroupCollection."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from hybridrl.engines.server import free_port

    started = not dist.is_initialized()
    if started:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, create_gloo_process_groups=False)
    try:
        yield ProcessGroupCollection.use_mpu_process_groups()
    finally:
        parallel_state.destroy_model_parallel()
        if started:
            dist.destroy_process_group()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """A model folder with only the config.json that a server engine's command line reads (context length, dtype),
    for the engines' tests without a GPU."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "dtype": "bfloat16"}))
    return d
