"""The optimizer state's move back onto the trainer's device (both trainers share it); the move to pinned CPU memory
needs a GPU and runs in the GPU studies."""

import torch

from hybridrl.trainers.offload import optimizer_state_to, optimizer_state_to_cpu


def test_the_state_moves_but_adamws_step_stays_on_the_cpu() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([w], lr=0.1)
    w.sum().backward()
    opt.step()
    optimizer_state_to_cpu(opt)  # nothing on a GPU here: it leaves CPU tensors alone
    [state] = opt.state.values()
    assert all(not v.is_pinned() for v in state.values())
    optimizer_state_to(opt, torch.device("meta"))  # a device other than the CPU, without a GPU
    assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
    assert state["step"].device.type == "cpu" and float(state["step"]) == 1.0


def _adamw_after_one_step(device: str) -> tuple[torch.nn.Parameter, torch.optim.AdamW]:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(64, 64, device=device))
    opt = torch.optim.AdamW([w], lr=0.1)
    (w * w).sum().backward()
    opt.step()
    return w, opt


def test_a_round_trip_through_pinned_memory_leaves_the_next_step_unchanged() -> None:
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: pinned memory and asynchronous copies")
    w, opt = _adamw_after_one_step("cuda")
    ref_w, ref_opt = _adamw_after_one_step("cuda")
    optimizer_state_to_cpu(opt)
    [state] = opt.state.values()
    assert all(v.is_pinned() for k, v in state.items() if k != "step") and not state["exp_avg"].is_cuda
    optimizer_state_to(opt, torch.device("cuda"))
    torch.cuda.synchronize()
    for p, o in ((w, opt), (ref_w, ref_opt)):
        (p * p).sum().backward()
        o.step()
    assert torch.equal(w, ref_w) and state["exp_avg"].is_cuda
